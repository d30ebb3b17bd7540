"""The claims checker: every number with a unit, a percentage or a ratio in a notebook's markdown is a stated fact —
a constant of the workload, a specification, or a figure cited with its source and hardware — listed with its
reason in tests/claims/<chapter>.txt, or it does not belong in markdown (a measurement is printed by the cell that
measured it). Vague multipliers stated as fact ("tens of times", "several times") are claims too.

A list line is `<the claim as written> | <why it is a fact>`. Inline code, math, links and code blocks are not
read (they are code, not claims)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
UNIT = (r"(?:%|×|x\b|ms\b|µs\b|us\b|ns\b|s\b|seconds?\b|minutes?\b|min\b|h\b|hours?\b|days?\b|GB/s|TB/s|GB\b|"
        r"GiB\b|MB\b|MiB\b|KB\b|kB\b|KiB\b|TB\b|bytes?\b|[GT]FLOP/s|[GT]FLOPS\b|[kMGT]?FLOPs?\b|GHz\b|MHz\b|W\b|"
        r"(?:steps|items|samples|images|tokens)/s\b|bits?\b|times\b|cores?\b|threads?\b|GPUs?\b|epochs?\b|steps?\b)")
NUMBER = r"(?<![\w.<,/])(?:~|≈|about |around |roughly )?\d[\d,. ]*(?:\s?[–-]\s?\d[\d,.]*)?\s?"
CLAIM = re.compile(NUMBER + UNIT)
VAGUE = re.compile(r"\b(?:tens|hundreds|thousands|several|a few|many) (?:of )?times\b|\borders? of magnitude\b", re.I)


def prose(markdown: str) -> str:
    """The markdown a learner reads as claims: without code blocks, inline code, math and link targets."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\$\$.*?\$\$|\$[^$\n]*\$", " ", text, flags=re.S)
    return re.sub(r"\]\([^)]*\)", "]", text)


def claims(markdown: str) -> list[str]:
    """The claims in `markdown`, whitespace-normalized, in order."""
    text = prose(markdown)
    found = [m.group(0) for m in CLAIM.finditer(text)] + [m.group(0) for m in VAGUE.finditer(text)]
    return [" ".join(c.split()) for c in found]


def facts(chapter: str) -> dict[str, str]:
    """The chapter's stated facts: {claim: reason}."""
    path = ROOT / "tests" / "claims" / f"{chapter}.txt"
    listed = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.strip() and not line.startswith("#"):
            claim, _, reason = line.partition(" | ")
            assert reason.strip(), f"{path.name}: '{claim}' needs a reason (a source, a specification, the workload)"
            listed[" ".join(claim.split())] = reason.strip()
    return listed


def unlisted(nb: Path) -> list[str]:
    """Claims in the notebook's markdown that its chapter's list does not hold."""
    listed = facts(nb.name[:2])
    bad = []
    for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
        if cell["cell_type"] == "markdown":
            bad += [f"cell {i}: {c!r}" for c in claims("".join(cell["source"])) if c not in listed]
    return bad


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_number_in_markdown_is_a_listed_fact(nb):
    bad = unlisted(nb)
    assert not bad, (f"{nb.name}: numbers in markdown that no cell printed and tests/claims/{nb.name[:2]}.txt does "
                     "not list as a stated fact (print measurements from the cell that measured them; list "
                     "specifications and cited figures with their source):\n  " + "\n  ".join(bad))


def test_the_checker_catches_what_it_must_negative_control():
    text = ("On a GPU this is typically tens of times faster. The fused loop ran 12.8× faster and used 54 % of the "
            "peak, about 3 ms per step on 2 cores.")
    assert claims(text) == ["12.8×", "54 %", "about 3 ms", "2 cores", "tens of times"]


def test_the_checker_leaves_code_math_and_links_alone():
    text = "Call `torch.randn(64, 4000)` then $2 \\times 10^3$ see [paper 3](https://x.org/1706.02677) ```\n8 bits\n```"
    assert claims(text) == []


@pytest.mark.parametrize("chapter", sorted(p.stem for p in (ROOT / "tests" / "claims").glob("*.txt")))
def test_every_listed_fact_is_still_used(chapter):
    """A list holds only facts a notebook states (an entry left behind after an edit is removed)."""
    nb = next((ROOT / "notebooks").glob(f"{chapter}_*.ipynb"))
    stated = {c for cell in json.loads(nb.read_text())["cells"] if cell["cell_type"] == "markdown"
              for c in claims("".join(cell["source"]))}
    assert not set(facts(chapter)) - stated, f"{chapter}.txt lists claims chapter {chapter} no longer makes"
