"""What-if calculator: the roofline time of one forward and where it goes.

    python -m sim.cost.latency model=llama3_70b hardware=h800x8 tp=4 tokens=8 context=512 \\
        quant=int4_awq [format=json] [layers=LO:HI]

model/hardware are preset names (conf/model, conf/hardware); quant defaults to the preset's;
tp (1), tokens (1), context (0) default as shown. Any tp up to the GPUs of one node is allowed:
heads and FFN are zero-padded to a multiple of tp (SwiftSpec §4). With format=json the last line
of stdout is one JSON object. Bad input: one line on stderr naming the key, exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from sim.cost.quant import QUANT_SPECS
from sim.cost.roofline_forward import RooflineForward, forward_cost
from sim.presets import load_hardware_preset, load_model_preset, preset_names
from testbed.config import ConfigError

KEYS = ("model", "hardware", "tp", "tokens", "context", "quant", "format", "layers")
BREAKDOWN = ("weights", "attention", "allreduce", "launch", "other")


def _int(args: dict[str, str], key: str, *, default: int, lo: int, hi: int, why: str) -> int:
    raw = args.get(key, str(default))
    allowed = f"an integer in [{lo}, {hi}] ({why})"
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(key, raw, allowed) from None
    if not lo <= value <= hi:
        raise ConfigError(key, value, allowed)
    return value


def _layers(raw: str, n: int) -> tuple[int, int]:
    lo, _, hi = raw.partition(":")
    if lo.isdigit() and hi.isdigit() and 0 <= int(lo) < int(hi) <= n:
        return int(lo), int(hi)
    raise ConfigError("layers", raw, f"LO:HI with 0 <= LO < HI <= {n}")


def parse(argv: list[str]) -> dict[str, Any]:
    """key=value arguments -> validated request (raises ConfigError)."""
    args: dict[str, str] = {}
    for a in argv:
        key, sep, value = a.partition("=")
        if not sep or key not in KEYS:
            raise ConfigError(key, value, "key=value with a key among " + ", ".join(KEYS))
        args[key] = value
    for key in ("model", "hardware"):
        if key not in args:
            raise ConfigError(key, "", "required: one of " + ", ".join(preset_names(key)))
    model = load_model_preset(args["model"])
    hw = load_hardware_preset(args["hardware"])
    quant = args.get("quant", model.quant)
    if quant not in QUANT_SPECS:
        raise ConfigError("quant", quant, "one of " + ", ".join(QUANT_SPECS))
    model = dataclasses.replace(model, quant=quant)
    tp = _int(args, "tp", default=1, lo=1, hi=hw.gpus_per_node, why=f"GPUs per node of {hw.name}")
    tokens = _int(args, "tokens", default=1, lo=1, hi=model.max_context, why=f"max_context of {model.name}")
    context = _int(args, "context", default=0, lo=0, hi=model.max_context - tokens,
                   why=f"context + tokens <= max_context {model.max_context} of {model.name}")
    fmt = args.get("format", "table")
    if fmt not in ("table", "json"):
        raise ConfigError("format", fmt, "one of table, json")
    layers = _layers(args["layers"], model.layers) if "layers" in args else None
    return {"model": model, "hardware": hw, "tp": tp, "tokens": tokens, "context": context,
            "format": fmt, "layers": layers}


def as_json(req: dict[str, Any], r: RooflineForward) -> dict[str, Any]:
    ms = {k: getattr(r, f"{k}_s") * 1e3 for k in BREAKDOWN}
    return {"model": req["model"].name, "hardware": req["hardware"].name, "tp": req["tp"],
            "tokens": req["tokens"], "context": req["context"], "quant": req["model"].quant,
            "layers": list(req["layers"]) if req["layers"] else [0, req["model"].layers],
            "total_ms": r.total_s * 1e3, "breakdown_ms": ms, **{f"{k}_ms": v for k, v in ms.items()},
            "hbm_bytes": r.hbm_bytes, "link_bytes": r.link_bytes, "flops": r.flops,
            "intensity_flop_per_byte": r.flops / r.hbm_bytes if r.hbm_bytes else 0.0,
            "bound": "compute" if r.compute_s > r.memory_s else "memory"}


def table(d: dict[str, Any]) -> str:
    lo, hi = d["layers"]
    head = (f"{d['model']} ({d['quant']}) on {d['hardware']}, tp={d['tp']}, tokens={d['tokens']}, "
            f"context={d['context']}, layers {lo}:{hi}")
    rows = [f"{'total':<22}{d['total_ms']:>10.3f} ms"]
    rows += [f"  {k:<20}{v:>10.3f} ms {100 * v / d['total_ms']:>5.1f}%"
             for k, v in d["breakdown_ms"].items()]
    rows += [f"{'HBM bytes / GPU':<22}{d['hbm_bytes'] / 1e6:>10.2f} MB",
             f"{'NVLink bytes / GPU':<22}{d['link_bytes'] / 1e6:>10.3f} MB",
             f"{'FLOPs / GPU':<22}{d['flops'] / 1e9:>10.2f} GFLOP",
             f"{'arithmetic intensity':<22}{d['intensity_flop_per_byte']:>10.2f} FLOP/B ({d['bound']}-bound)"]
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(__doc__.strip() + "\n\nmodels: " + ", ".join(preset_names("model"))
              + "\nhardware: " + ", ".join(preset_names("hardware")))
        return 0
    try:
        req = parse(argv)
        r = forward_cost(req["model"], req["hardware"], tp=req["tp"], tokens=req["tokens"], context=req["context"],
                         layers=req["layers"])
    except (ConfigError, ValueError) as e:
        print(f"sim.cost.latency: {e}", file=sys.stderr)
        return 2
    d = as_json(req, r)
    print(json.dumps(d) if req["format"] == "json" else table(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
