"""Checks of a written report that a reader would notice: markdown left raw in the HTML, a
figure whose text runs off its canvas. Used by the headless-browser test and by the tests of the
report sections (which run without a browser); and the recorded runs a validation report needs."""

from __future__ import annotations

import html
import re
from pathlib import Path

from testbed.recorder import RequestRecord, RunRecorder, RunResult
from testbed.results import write_run
from tests.conftest import compose_exp

EDGE_PX = 3  # drawn pixels this close to the canvas edge: something was cut there (layouts leave ~10)
BACKGROUND_TOLERANCE = 30  # summed |RGB| difference from the corner pixel that counts as drawn


def visible_text(report_html: str) -> str:
    """The text a browser shows for report.html (tags dropped, entities decoded), line by line."""
    body = re.sub(r"<(style|script)[^>]*>.*?</\1>", "", report_html, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", body))


def raw_markdown_lines(text: str) -> list[str]:
    """Lines of rendered text that are still markdown source: table rows (`| a | b |`),
    delimiter rows, headings."""
    return [line for line in text.splitlines()
            if line.lstrip().startswith("|") or re.match(r"\s*(#{1,6} |\|?-{3,}\|)", line)]


def drawn_extent(png: Path) -> tuple[tuple[int, int, int, int], tuple[int, int]]:
    """The bounding box (x0, y0, x1, y1) of everything drawn on the PNG (pixels that differ from
    the background, the top-left corner's colour) and the canvas size (w, h)."""
    import numpy as np
    from PIL import Image

    a = np.asarray(Image.open(png).convert("RGB")).astype(int)
    drawn = np.abs(a - a[0, 0]).sum(axis=2) > BACKGROUND_TOLERANCE
    ys, xs = np.nonzero(drawn)
    h, w = drawn.shape
    if len(xs) == 0:
        return (0, 0, 0, 0), (w, h)
    return (int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())), (w, h)


def clipped_figures(out_dir: Path) -> list[str]:
    """The report's figures whose drawing touches the canvas edge (a label or legend cut off by
    the PNG's border), each with its extent and canvas size."""
    bad = []
    for png in sorted(Path(out_dir).glob("*.png")):
        (x0, y0, x1, y1), (w, h) = drawn_extent(png)
        if min(x0, y0) < EDGE_PX or x1 >= w - EDGE_PX or y1 >= h - EDGE_PX:
            bad.append(f"{png.name}: drawn ({x0}, {y0})-({x1}, {y1}) on a {w}x{h} canvas")
    return bad


def write_prompts_run(path: Path, backend: str, split: str, schedule: str, accepted: list[int],
                      round_s: float = 0.01) -> None:
    """A run of one request per entry of `accepted` (40 tokens each, every round keeping that
    many guesses, `round_s` per round); `schedule`: the schedule's overrides."""
    exp = compose_exp(f"backend={backend}", "pair=smollm2_135m+ngram3", "hardware=local",
                      "workload=humaneval", f"workload.split={split}", *schedule.split())
    rec = RunRecorder()
    for rid, acc in enumerate(accepted):
        generated, r = 0, 0
        while generated < 40:
            e = min(acc + 1, 40 - generated)
            rec.round(request_id=rid, round_idx=r, start_s=r * round_s, end_s=(r + 1) * round_s,
                      drafted=4, checked=acc + 1, accepted=acc, emitted=e, verified_tokens=5)
            generated += e
            r += 1
        rec.request(RequestRecord(request_id=rid, prompt_id=f"HumanEval/{rid}", prompt_len=100,
            output_ids=[], generated=40, prefill_s=0.1, decode_s=r * round_s, rounds=r))
    write_run(path, exp, RunResult(recorder=rec))
