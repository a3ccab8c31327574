"""testbed.report.style: how every report figure is written."""

from __future__ import annotations

from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


def test_a_laid_out_figure_is_drawn_once_when_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tight_layout leaves a placeholder layout engine, and with any engine set savefig draws
    the figure once more before printing it; savefig drops the placeholder, not the layout."""
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    from testbed.report.style import savefig

    draws: list[int] = []
    real_draw = Figure.draw
    monkeypatch.setattr(Figure, "draw", lambda self, renderer: (draws.append(1), real_draw(self, renderer))[1])
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1])
    ax.set_ylabel("a label the layout makes room for")
    fig.tight_layout()
    left = fig.subplotpars.left
    savefig(fig, tmp_path / "f.png")
    assert len(draws) == 1
    assert left > 0.1  # the layout tight_layout computed is what was saved
    from PIL import Image

    assert Image.open(tmp_path / "f.png").size == (400, 300)  # natural size: figsize x 100 dpi
