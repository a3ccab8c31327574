"""The project's documentation (README.md, CONTRIBUTING.md, docs/*.md): the README stays a
user's guide of at most 300 lines, every relative link and #anchor resolves, and the text speaks
of the project only — no dates of work, no sessions, no paths of one particular machine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300

# what would tie the text to who worked when, or to one machine's file system
FORBIDDEN = {
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a session": re.compile(r"\bsessions?\b", re.IGNORECASE),
    "a machine path": re.compile(r"(?<![\w.~$])/(work|tmp|home|root|mnt|scratch)/"),
}


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            out.add(_anchor(m.group(1)))
    return out


def test_the_readme_is_a_guide_of_at_most_300_lines() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines: move depth to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", link):  # http(s):, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
            broken.append(link)
    assert broken == [], f"{page.name}: links that do not resolve: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_text_names_no_date_session_or_machine_path(page: Path) -> None:
    found = [f"line {i}: {what}: {line.strip()[:80]}"
             for i, line in enumerate(page.read_text().splitlines(), 1)
             for what, pattern in FORBIDDEN.items() if pattern.search(line)]
    assert found == [], f"{page.name}:\n" + "\n".join(found)


def test_the_docs_the_readme_points_to_exist() -> None:
    for name in ("architecture", "calibration", "configuration", "performance", "kernels", "gpu"):
        assert (ROOT / "docs" / f"{name}.md").is_file(), name
    assert (ROOT / "CONTRIBUTING.md").is_file()
