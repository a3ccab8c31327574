"""`python -m testbed --help`: config groups with their options, then the settings by section.

Read from conf/ and the schema dataclasses only (no Hydra composition), so it is instant.
Pairs are listed as the rule (TARGET+DRAFT of model presets), not as their 256 combinations.
Each setting's meaning and unit are the config dataclasses' own field docs (testbed.config.doc),
the same text validation errors quote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import textwrap

from testbed.config import ExperimentConfig, setting_doc
from testbed.paths import CONF_DIR

GROUP_NOTES = {
    "backend": "simulate (SimPy) or execute on this machine",
    "schedule": "decoding schedule",
    "pair": "target + draft models",
    "hardware": "modelled node (local: this machine)",
    "network": "links between nodes (decentralized)",
    "acceptance": "where the simulator's token distributions come from",
    "workload": "prompt set",
    "lookahead": "draft tokens per round",
    "sweep": "a multirun with its comparison report (+sweep=NAME)",
    "tp": "tensor parallelism of both models, one sweep axis (+tp=NAME)",
}
FLAGS = {"calibrate": "+calibrate"}  # schema keys given as a flag on the command line
WIDTH = 100
HIDDEN_GROUPS = ("model", "split", "validate")  # parts of pairs and sweeps


def _options(group: str) -> list[str]:
    names = {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
    if group == "schedule":  # and the schedules of plug-ins (testbed.schedules)
        from testbed.schedules import schedule_names

        names |= set(schedule_names())
    return sorted(names)


def _settings() -> dict[str, list[tuple[str, str, str]]]:
    """section -> [(key, type, default)] from the schema and its defaults (a flag: its
    command-line spelling, type `flag`, default `off`)."""
    out: dict[str, list[tuple[str, str, str]]] = {}

    def walk(obj: object, prefix: str, section: str) -> None:
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            key = prefix + f.name
            if dataclasses.is_dataclass(value):
                if key in ("pair", "hardware"):
                    continue  # chosen as presets (pair=, hardware=), keys listed in conf/
                walk(value, key + ".", section or f.name)
            elif key in FLAGS:
                out.setdefault(section or "general", []).append((key, "flag", "on" if value else "off"))
            else:
                t = type(value).__name__ if value is not None else "str"
                out.setdefault(section or "general", []).append((key, t, repr(value) if isinstance(value, str) else str(value)))
    walk(ExperimentConfig(), "", "")
    return out


def help_text() -> str:
    lines = ["usage: python -m testbed [GROUP=OPTION ...] [KEY=VALUE ...] [-m]",
             "",
             "Run one experiment (backend=sim: simulated; backend=real: executed here), or a sweep",
             "(+sweep=NAME, or KEY=a,b,c with -m). Results: reports/runs/ or reports/sweeps/.",
             "", "Config groups (GROUP=OPTION):"]
    for d in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in HIDDEN_GROUPS):
        note = GROUP_NOTES.get(d.name, "")
        if d.name == "pair":
            models = ", ".join(_options("model"))
            body = (f"TARGET+DRAFT, any two model presets sharing a tokenizer; published: "
                    f"{', '.join(_options('pair'))}; models: {models}")
        else:
            body = ", ".join(_options(d.name))
        if not body:  # a folder of sub-groups or other files only: nothing to choose by name
            continue
        prefix = f"  {d.name:<11}"
        lines.append(f"{prefix}{note}")  # what the group chooses, then its options
        wrapped = textwrap.wrap(body, width=WIDTH - len(prefix), break_on_hyphens=False)
        lines += [" " * len(prefix) + w for w in wrapped]
    lines += ["", "Settings (KEY=VALUE; type, default; what it means [unit]):"]
    for section, items in _settings().items():
        lines.append(f"  {section}:")
        for key, t, default in items:
            lines.append(f"    {FLAGS.get(key, key):<30} {t:<6} {default}")
            lines += textwrap.wrap(setting_doc(key), width=WIDTH, initial_indent=" " * 8,
                                   subsequent_indent=" " * 8, break_on_hyphens=False)
    lines += ["", "Sweeps: -m KEY=a,b (cartesian product); hydra/launcher=joblib runs jobs on every core",
              "(backend=sim); hydra/launcher=submitit_local|submitit_slurm for clusters. Re-running a",
              "sweep with the same hydra.sweep.dir=DIR skips its finished jobs.",
              "Reports: python -m testbed.report DIR... [--out DIR].  Hydra's own help: --hydra-help.",
              "Errors name the key and what is allowed, exit code 2; see README.md."]
    return "\n".join(lines)


def print_help() -> None:
    with contextlib.suppress(BrokenPipeError):  # `--help | head`
        print(help_text(), flush=True)
