"""The guides' map (docs/guides.md) and the Chinese README point at what exists: every chapter cell the map cites is a
cell of that chapter, every relative link resolves, every guide item is mapped or says why not, the Chinese README's
chapter table lists every chapter once with README.md's Colab badge, and README.md links the Chinese README. Pure
file reading: no notebook runs, no torch import."""

import json
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guides.md"
README = ROOT / "README.md"
README_ZH = ROOT / "README_zh.md"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

LINK = re.compile(r"\]\(([^)\s]+)\)")  # a Markdown link's target
CHAPTER_LINK = re.compile(r"\]\(((?:\.\./)?notebooks/[^)#\s]+)(?:#([^)\s]*))?\)")  # target, cell id (or None)
CELL_ID = re.compile(r"[0-9a-f]{8}")
ITEM_ROW = re.compile(r"^\| (G\d)\.(\d+) \|", re.M)
SUMMARY_ROW = re.compile(r"^\| (G\d) \| ([^|]+) \| [^|]+ \| (\d+) \| (\d+) \|$", re.M)
BADGE = re.compile(r"\((https://colab\.research\.google\.com/github/[^)\s]+\.ipynb)\)")  # a Colab badge's address
NOT_COVERED = "**Not covered"
TABLE_HEADING = "## 章节一览"


@cache
def cell_ids(notebook: Path) -> frozenset[str]:
    """The `id` of every cell of a notebook, read from its JSON."""
    return frozenset(c.get("id", "") for c in json.loads(notebook.read_text())["cells"])


def cell_problems(text: str, base: Path) -> list[str]:
    """Chapter references of a page in `base` that do not hold: a missing chapter, a reference without a cell id,
    an id that is not 8 hex digits, or an id that is not a cell of that chapter."""
    found = []
    for target, cell in CHAPTER_LINK.findall(text):
        path = (base / target).resolve()
        if not path.is_file():
            found.append(f"{target}: no such chapter")
        elif not cell:
            found.append(f"{target}: names no cell (add #<cell id>)")
        elif not CELL_ID.fullmatch(cell):
            found.append(f"{target}#{cell}: a cell id is 8 hex digits")
        elif cell not in cell_ids(path):
            found.append(f"{target}#{cell}: no cell with this id in the chapter")
    return found


def broken_links(text: str, base: Path) -> list[str]:
    """Relative link targets of a page in `base` that name no file or folder (web addresses are not checked)."""
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]
    return [t for t in targets if not (base / t.split("#", 1)[0]).exists()]


def unmapped_items(text: str) -> list[str]:
    """Guide items (table rows G<n>.<k>) that neither cite a chapter cell nor say why they are not covered."""
    rows = [line for line in text.splitlines() if ITEM_ROW.match(line)]
    return [row.split("|")[1].strip() for row in rows if not CHAPTER_LINK.search(row) and NOT_COVERED not in row]


def item_counts(text: str) -> dict[str, tuple[int, int]]:
    """Per guide, from its rows: (items, items not covered); the items must be numbered 1, 2, ... in order."""
    numbers: dict[str, list[int]] = {}
    uncovered: dict[str, int] = {}
    for line in text.splitlines():
        m = ITEM_ROW.match(line)
        if m:
            numbers.setdefault(m[1], []).append(int(m[2]))
            uncovered[m[1]] = uncovered.get(m[1], 0) + (NOT_COVERED in line)
    for guide, seen in numbers.items():
        assert seen == list(range(1, len(seen) + 1)), f"{guide}'s items are not numbered 1..{len(seen)} in order"
    return {g: (len(n), uncovered[g]) for g, n in numbers.items()}


def chapter_table(text: str) -> list[tuple[str, str, str | None]]:
    """(number, chapter file, Colab badge address or None) of each row of the Chinese README's chapter table."""
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        chapter = CHAPTER_LINK.search(line)
        if line.startswith("| ") and chapter:
            badge = BADGE.search(line)
            rows.append((line.split("|")[1].strip(), Path(chapter[1]).name, badge[1] if badge else None))
    return rows


def table_problems(rows: list[tuple[str, str, str | None]], notebooks: list[str], badges: dict[str, str]) -> list[str]:
    """What is wrong with a chapter table: a chapter missing or listed twice, a file that is no chapter, a number
    that is not the file's, a Colab badge other than README.md's for that chapter (`make links` rewrites README.md's
    badges only: copy them)."""
    listed = [name for _, name, _ in rows]
    found = [f"{nb}: listed {listed.count(nb)} times, not once" for nb in notebooks if listed.count(nb) != 1]
    found += [f"{name}: not a chapter in notebooks/" for name in listed if name not in notebooks]
    for number, name, badge in rows:
        if number != name[:2]:
            found.append(f"{name}: row numbered {number!r}")
        if badge != badges.get(name):
            found.append(f"{name}: Colab badge {badge}, README.md's is {badges.get(name)}")
    return found


def readme_badges() -> dict[str, str]:
    """README.md's Colab badge address for each chapter (the first, where it has several)."""
    found: dict[str, str] = {}
    for url in BADGE.findall(README.read_text()):
        found.setdefault(Path(url).name, url)
    return found


# --- the pages as they are ------------------------------------------------------------------------------------------


def test_every_cell_the_guides_map_cites_is_in_its_chapter():
    text = GUIDES.read_text()
    assert len(CHAPTER_LINK.findall(text)) > 100, "docs/guides.md cites almost no cells: is it the map?"
    assert cell_problems(text, GUIDES.parent) == []


@pytest.mark.parametrize("page", [GUIDES, README_ZH], ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    assert broken_links(page.read_text(), page.parent) == []


def test_every_guide_item_is_mapped_or_says_why_not():
    assert unmapped_items(GUIDES.read_text()) == []


def test_the_summary_counts_the_items_and_titles_the_sections():
    text = GUIDES.read_text()
    summary = {g: (title.strip(), int(n), int(out)) for g, title, n, out in SUMMARY_ROW.findall(text)}
    assert sorted(summary) == ["G1", "G2", "G3"]
    assert item_counts(text) == {g: (n, out) for g, (_, n, out) in summary.items()}
    for guide, (title, _, _) in summary.items():
        assert f"\n## {guide} · {title}\n" in text, f"{guide}'s section heading is not its title, {title}"


def test_the_chinese_readme_lists_every_chapter_once_with_readme_badges():
    badges = readme_badges()
    names = [nb.name for nb in NOTEBOOKS]
    assert [n for n in names if n not in badges] == [], "README.md has no Colab badge for these chapters"
    assert table_problems(chapter_table(README_ZH.read_text()), names, badges) == []


def test_the_chinese_readme_points_to_the_guides_map():
    assert "](docs/guides.md)" in README_ZH.read_text()


def test_readme_links_the_chinese_readme_near_the_top():
    top = README.read_text().splitlines()[:10]
    assert sum("](README_zh.md)" in line for line in top) == 1


# --- negative controls: the checkers reject what they must ----------------------------------------------------------


def test_the_cell_check_rejects_made_up_cells_and_chapters():
    real, a_cell = NOTEBOOKS[0].name, sorted(cell_ids(NOTEBOOKS[0]))[0]
    page = (
        f"[a](../notebooks/{real}#0badcafe) [b](../notebooks/{real}) [c](../notebooks/{real}#NOT-HEX) "
        f"[d](../notebooks/99_no_such_chapter.ipynb#12345678) [e](../notebooks/{real}#{a_cell})"
    )
    found = cell_problems(page, GUIDES.parent)
    assert len(found) == 4
    assert "no cell with this id" in found[0] and "names no cell" in found[1] and "8 hex digits" in found[2]
    assert "no such chapter" in found[3]


def test_the_link_check_rejects_a_missing_file_and_keeps_web_addresses():
    page = "[x](../notebooks/00_missing.ipynb) [y](https://example.org/nowhere) [z](#anchor) [w](../README.md#top)"
    assert broken_links(page, GUIDES.parent) == ["../notebooks/00_missing.ipynb"]


def test_the_item_check_rejects_an_unmapped_item_and_a_gap_in_the_numbering():
    rows = "| G9.1 | a claim | — | runs nothing |\n| G9.2 | another | — | **Not covered:** why |\n"
    assert unmapped_items(rows) == ["G9.1"]
    with pytest.raises(AssertionError, match="not numbered"):
        item_counts(rows + "| G9.4 | a skipped number | — | **Not covered:** why |\n")


def test_the_table_check_rejects_a_missing_a_doubled_a_misnumbered_and_a_stale_chapter():
    names = [nb.name for nb in NOTEBOOKS]
    badges = readme_badges()
    rows = [(n[:2], n, badges[n]) for n in names]
    assert table_problems(rows, names, badges) == []
    stale = badges[names[-1]].replace("/blob/", "/blob/old-")
    found = table_problems(rows[1:] + [rows[1], ("7", names[-1], stale)], names, badges)
    assert any(names[0] in p and "0 times" in p for p in found)
    assert any(names[1] in p and "2 times" in p for p in found)
    assert any("numbered '7'" in p for p in found) and any("old-" in p for p in found)
