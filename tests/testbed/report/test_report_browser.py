"""The sweep report as a browser shows it: headless Chromium loads report.html, and a script
checks that every image loaded, that no figure is a strip (wider than tall by more than 4:1)
or too wide to read at its natural size, that every figure links to its full size, that no
markdown is left raw in the text (a table that did not render reads as lines of `| … |`), and
that no table is wider than the page; each PNG's drawn extent is compared with its canvas (a
drawing that touches the edge had a label or legend cut off).

Skipped when no Chromium binary is installed (`apt-get install chromium`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sim.runtime.engine import run
from testbed.report import build_report
from testbed.results import write_run
from tests.conftest import compose_exp
from tests.helpers.report_checks import clipped_figures, write_prompts_run

MAX_ASPECT = 4.0
MAX_WIDTH_PX = 1600
PAGE_PX = 1400  # the browser window (the report's body is at most 1200 px of it)

CHECK = r"""<script>
window.addEventListener("load", () => {
  const imgs = [...document.images].map(i => ({src: i.getAttribute("src"), w: i.naturalWidth,
    h: i.naturalHeight, ok: i.complete && i.naturalWidth > 0,
    link: i.parentElement.tagName === "A" ? i.parentElement.getAttribute("href") : null}));
  const th = document.querySelectorAll("th").length;
  const page = document.documentElement.clientWidth;
  const wide = [...document.querySelectorAll("table")].map(t => ({
      right: Math.ceil(t.getBoundingClientRect().right), header: t.rows[0].innerText.slice(0, 80)}))
    .filter(t => t.right > page);
  const raw = document.body.innerText.split("\n").filter(l => /^\s*(\||#{1,6} |-{3,}\|)/.test(l));
  const pre = document.createElement("pre");
  pre.id = "check";
  pre.textContent = JSON.stringify({imgs, th, text: document.body.innerText.includes("`"), page,
                                    wide, raw, scroll: document.documentElement.scrollWidth});
  document.body.appendChild(pre);
});
</script>"""


def chromium() -> str | None:
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome",
                                                        "chrome")) if p), None)


def wide_run(sweep: Path) -> None:
    """A run that makes the runs table wider than the page unless it wraps: more key fields vary."""
    exp = compose_exp("sampling.temperature=0.7", "seed=3", "workload=humaneval",
                      "workload.num_prompts=1", "workload.max_new_tokens=16")
    write_run(sweep / "wide", exp, run(exp))


def validation_runs(sweep: Path) -> None:
    """A measured tree run, its trace source and its prediction: the validation sections (their
    error tables and the transfer between prompt splits, whose header holds pipes)."""
    tree = "schedule=sync schedule.tree=true"
    write_prompts_run(sweep / "val_trace", "real", "trace", tree, [3, 2, 1])
    write_prompts_run(sweep / "val_test", "real", "test", tree, [1, 2, 2])
    write_prompts_run(sweep / "val_pred", "sim", "test", tree, [3, 2, 1])


def sweep_report(tmp: Path) -> Path:
    small = ("workload.num_prompts=2", "workload.max_new_tokens=48")
    jobs = {f"split_{s}": (f"+split={s}",) for s in ("t2", "t4", "t6", "sync", "sync_tree")}
    jobs |= {f"gamma_{g}": (f"schedule.gamma={g}",) for g in (1, 3, 5)}
    jobs |= {f"dsd_{lat}": ("schedule=decentralized", "hardware=a800_nodes", "placement.nodes=2",
                            "network=wan", f"network.latency_ms={lat}") for lat in (0, 20)}
    sweep = tmp / "sweep"
    for i, (_, overrides) in enumerate(jobs.items()):
        exp = compose_exp(*overrides, *small)
        write_run(sweep / str(i), exp, run(exp))
    wide_run(sweep)
    validation_runs(sweep)
    return build_report([sweep], sweep)


def test_sweep_report_renders_in_chromium(tmp_path: Path) -> None:
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium binary on PATH (apt-get install chromium) for the headless report check")
    report = sweep_report(tmp_path).with_suffix(".html")
    page = report.parent / "_check.html"
    page.write_text(report.read_text() + CHECK)
    # no network here: without the background-networking flags Chromium retries its connections
    quiet = ["--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-quic", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    p = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
                        *quiet, f"--window-size={PAGE_PX},1000", "--virtual-time-budget=15000", "--dump-dom", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    import psutil

    profile = str(tmp_path / "profile")
    left = [q.pid for q in psutil.process_iter(["cmdline"]) if any(profile in a for a in q.info["cmdline"] or [])]
    assert not left, f"chromium processes left behind: {left}"
    m = re.search(r'<pre id="check">(.*?)</pre>', p.stdout, re.S)
    assert m, f"no result from chromium: {p.stderr[-1500:]}"
    result = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    imgs = result["imgs"]
    assert len(imgs) >= 4
    for img in imgs:
        assert img["ok"], f"{img['src']} did not load"
        assert img["w"] <= MAX_ASPECT * img["h"], f"{img['src']} is a strip: {img['w']}x{img['h']}"
        assert img["w"] <= MAX_WIDTH_PX, f"{img['src']} is {img['w']} px wide"
        assert img["link"] == img["src"], f"{img['src']} does not link to its full size"
    assert result["th"] > 0, "tables without header cells"
    assert not result["text"], "literal backticks in the rendered report"
    assert not result["raw"], f"markdown left raw in the rendered report: {result['raw'][:3]}"
    assert not result["wide"], f"tables wider than the {result['page']} px page: {result['wide']}"
    assert result["scroll"] <= result["page"], "the page scrolls sideways"
    assert not clipped_figures(report.parent), "figures drawn to their edge (text cut off)"
