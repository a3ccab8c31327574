"""Checks of a written report that a reader would notice: markdown left raw in the HTML, a
figure whose text runs off its canvas. Used by the headless-browser test and by the tests of the
report sections (which run without a browser)."""

from __future__ import annotations

import html
import re
from pathlib import Path

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
