"""The claims checker: every number with a unit, a percentage or a ratio in a notebook's markdown is a stated fact —
a constant of the workload, a specification, or a figure cited with its source and hardware — listed with its
reason in tests/claims/<chapter>.txt, or it does not belong in markdown (a measurement is printed by the cell that
measured it). Vague multipliers stated as fact ("tens of times", "several times") are claims too.

A list line is `<the claim as written> | <why it is a fact>`. Inline code, math, links and code blocks are not
read (they are code, not claims).

Besides markdown, the checker reads what code cells state in words: the literal text of printed strings (an f-string's
fixed parts, not the measured values it formats) and comments. It also catches numbers spelled out in words next to a
unit ("ten matmuls", "two-minute"), values in scientific notation, sources that are not named ("a popular guide",
"older tutorials": name the book's chapter, the post, the docs page, and link it), and references to files outside
the repository (a learner has only the repository)."""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from pathlib import Path

import pytest

from tools import nbexport

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
UNIT = (r"(?:%|×(?!\s?\d)|x\b(?!\s?\d)|ms\b|µs\b|us\b|ns\b|s\b|seconds?\b|minutes?\b|min\b|h\b|hours?\b|days?\b|"
        r"GB/s|TB/s|GB\b|"
        r"GiB\b|MB\b|MiB\b|KB\b|kB\b|KiB\b|TB\b|bytes?\b|[GT]FLOP/s|[GT]FLOPS\b|[kMGT]?FLOPs?\b|GHz\b|MHz\b|W\b|"
        r"(?:steps|items|samples|images|tokens)/s\b|bits?\b|times\b|cores?\b|threads?\b|GPUs?\b|epochs?\b|steps?\b|"
        r"parameters\b|rows\b|batches\b|numbers\b|images\b|units\b|matmuls?\b|percent\b|million\b|billion\b)")
NUMBER = r"(?<![\w.<,/])(?:~|≈|about |around |roughly )?\d(?:[\d,.]*\d)?(?: \d{3})*(?:\s?[–-]\s?\d[\d,.]*)?\s?"
CLAIM = re.compile(NUMBER + r"(?:[A-Za-z][\w-]* )?" + UNIT)  # "2 cores", "2 CPU cores", "200 Adam steps"
WORD = (r"(?:two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen|twenty|"
        r"thirty|forty|fifty|sixty|seventy|eighty|ninety|hundred|thousand|million|billion)")
SPELLED = re.compile(rf"\b{WORD}(?:[ -]{WORD})*[ -](?:{UNIT[3:-1]}|minute\b|second\b|hour\b|day\b|layer\b|"
                     r"matmuls?\b|models?\b|kernels?\b)", re.I)
SCIENTIFIC = re.compile(r"(?<![\w.])\d+(?:\.\d+)?e[-+]?\d+\b")
UNNAMED = re.compile(r"\b(?:popular|some|many|most|other|older|several) (?:\w+ )?(?:guides?|tutorials?|notebooks?|"
                     r"posts?|blogs?|articles?|code|courses?|scripts?)\b|"
                     r"\bthe (?:DDP |acceleration |performance )?guide\b", re.I)
OUTSIDE = re.compile(r"\bDESIGN(?:\.md)?\b|\.\./shared|\bshared/(?:DESIGN|reviews|colab)")
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
    found = [m.group(0) for rule in (CLAIM, VAGUE, SPELLED, SCIENTIFIC) for m in rule.finditer(text)]
    return [" ".join(c.split()) for c in found]


def sources(text: str) -> list[str]:
    """Sources named too vaguely to be found, and references to files outside the repository."""
    plain = prose(text)
    unlinked = [m.group(0) for m in UNNAMED.finditer(plain)
                if not (m.group(0).lower().startswith("the ") and "](http" in text)]
    return unlinked + [m.group(0) for m in OUTSIDE.finditer(plain)]


def stated_in_code(source: str) -> str:
    """What a code cell states in words: its comments and the fixed text of the strings it prints."""
    lines = nbexport.python_of(source)
    words = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(lines).readline):
            if tok.type == tokenize.COMMENT and not tok.string.startswith("#|"):
                words.append(tok.string.lstrip("# "))
        tree = ast.parse(lines)
    except (SyntaxError, tokenize.TokenError):
        return ""
    def literal(node: ast.AST) -> None:  # the fixed text only: not a formatted value nor its format spec
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            words.append(node.value)
        elif not isinstance(node, ast.FormattedValue):
            for child in ast.iter_child_nodes(node):
                literal(child)

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "print":
            for arg in node.args:
                literal(arg)
    return "\n".join(words)


def cell_text(cell: dict) -> str:
    """The words a learner reads in a cell: markdown, or a code cell's comments and printed text."""
    src = "".join(cell["source"])
    return src if cell["cell_type"] == "markdown" else stated_in_code(src)


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


KINDS = re.compile(r"https?://|\b(?:workload|constants?|arithmetic|definition|specification|counted|exercise|"
                   r"man page|datasheet|IEEE \d+|source|docs)\b", re.I)


def reason_problem(reason: str) -> str | None:
    """What is wrong with a listed fact's reason: it must be a constant of the workload or of a check, arithmetic
    shown, a definition or specification, or a named source (linked, or a man page, a datasheet, a standard, a
    library's source or docs), and name no source too vaguely to be found."""
    vague = sources(reason)
    if vague:
        return f"names a source too vaguely to be found: {', '.join(map(repr, vague))}"
    if not KINDS.search(reason):
        return "says neither which constant, which arithmetic, nor which named source makes it a fact"
    return None


def unlisted(nb: Path) -> list[str]:
    """Claims in the notebook's markdown that its chapter's list does not hold."""
    listed = facts(nb.name[:2])
    bad = []
    for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
        bad += [f"cell {i}: {c!r}" for c in claims(cell_text(cell)) if c not in listed]
    return bad


def unnamed(nb: Path) -> list[str]:
    """Vague sources and outside references anywhere a learner reads."""
    return [f"cell {i}: {s!r}" for i, cell in enumerate(json.loads(nb.read_text())["cells"])
            for s in sources(cell_text(cell))]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_number_in_markdown_is_a_listed_fact(nb):
    bad = unlisted(nb)
    assert not bad, (f"{nb.name}: numbers in markdown that no cell printed and tests/claims/{nb.name[:2]}.txt does "
                     "not list as a stated fact (print measurements from the cell that measured them; list "
                     "specifications and cited figures with their source):\n  " + "\n  ".join(bad))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_source_is_named_and_inside_the_repository(nb):
    bad = unnamed(nb)
    assert not bad, (f"{nb.name}: name and link the source (the book's chapter, the post, the docs page), and refer "
                     "only to files in the repository:\n  " + "\n  ".join(bad))


def test_the_sharpened_rules_each_catch_their_case():
    assert claims("ten matmuls per step, a two-minute wait, ten thousand parameters") == [
        "ten matmuls", "two-minute", "ten thousand parameters"]
    assert claims("the weights differ by about 1e-2 after 200 Adam steps") == ["200 Adam steps", "1e-2"]
    assert claims("one model and a batch") == []  # 'one' and 'a' are not counted
    assert sources("As a popular guide says, and older tutorials do") == ["popular guide", "older tutorials"]
    assert sources("The DDP guide says so.") == ["The DDP guide"]
    assert sources("The [DDP guide](https://pytorch.org/tutorials/intermediate/ddp_tutorial.html) says so.") == []
    assert sources("(Remember DESIGN's warning)") == ["DESIGN"] and sources("see ../shared/x") == ["../shared"]
    code = ('x = 1  # costs ~10-20 s on 2 CPU cores\n'
            'print(f"{n} models\' activations (8 MB per layer) no longer fit")\n'
            'y = "13 ms"  # a string that is not printed is not a claim\n')
    assert claims(stated_in_code(code)) == ["~10-20 s", "2 CPU cores", "8 MB"]
    assert "13 ms" not in stated_in_code(code)


def test_the_checker_catches_what_it_must_negative_control():
    text = ("On a GPU this is typically tens of times faster. The fused loop ran 12.8× faster and used 54 % of the "
            "peak, about 3 ms per step on 2 cores.")
    assert claims(text) == ["12.8×", "54 %", "about 3 ms", "2 cores", "tens of times"]


def test_the_checker_leaves_code_math_and_links_alone():
    text = "Call `torch.randn(64, 4000)` then $2 \\times 10^3$ see [paper 3](https://x.org/1706.02677) ```\n8 bits\n```"
    assert claims(text) == []


@pytest.mark.parametrize("chapter", sorted(p.stem for p in (ROOT / "tests" / "claims").glob("*.txt")))
def test_every_listed_reason_is_a_constant_arithmetic_or_a_named_source(chapter):
    bad = [f"{claim!r}: {why}" for claim, reason in facts(chapter).items() if (why := reason_problem(reason))]
    assert not bad, f"tests/claims/{chapter}.txt:\n  " + "\n  ".join(bad)


def test_the_reason_rule_rejects_vague_and_missing_sources_negative_control():
    assert reason_problem("a popular guide") == "names a source too vaguely to be found: 'popular guide'"
    assert reason_problem("everyone knows it").startswith("says neither which constant")
    assert reason_problem("older tutorials on the web (https://example.org)").startswith("names a source too vaguely")
    for good in ("workload: 4 hidden layers", "cited: sbatch man page, --signal", "arithmetic: 2^-5 = 1/32",
                 "NVIDIA T4 datasheet (https://www.nvidia.com/t4)", "the tolerance of the check, a constant of it"):
        assert reason_problem(good) is None, good


@pytest.mark.parametrize("chapter", sorted(p.stem for p in (ROOT / "tests" / "claims").glob("*.txt")))
def test_every_listed_fact_is_still_used(chapter):
    """A list holds only facts a notebook states (an entry left behind after an edit is removed)."""
    nb = next((ROOT / "notebooks").glob(f"{chapter}_*.ipynb"))
    stated = {c for cell in json.loads(nb.read_text())["cells"] for c in claims(cell_text(cell))}
    assert not set(facts(chapter)) - stated, f"{chapter}.txt lists claims chapter {chapter} no longer makes"


# --- time claims (#40 item 5): "about a minute" only where the recorded course run says so -----------------------
A_MINUTE = re.compile(r"\b(?:about|under|within|in|around) (?:a|one) minute\b(?! or two)|\ba minute or (?:so|less)\b",
                      re.I)
MINUTE_S = 60


def minute_claims(nb: Path) -> list[str]:
    """The sentences of a chapter's markdown that promise it runs in about a minute."""
    text = "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "markdown")
    return [m.group(0) for m in A_MINUTE.finditer(text)]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_chapter_promises_a_minute_only_if_its_recorded_run_took_one(nb):
    """Each chapter's setup cell prints its time in the newest recorded course run; its prose may not promise less."""
    import accelhelpers as ah

    timed = ah.results.recorded_seconds(nb.name[:2])
    if timed is None:
        pytest.skip("no recorded quick-profile course run of this chapter in results/")
    seconds, _, folder = timed
    if seconds > MINUTE_S:
        assert minute_claims(nb) == [], (f"{nb.name} took {seconds:.0f} s in results/{folder.name}: say 'a few "
                                         "minutes' (the setup cell prints the measured time)")


def test_the_minute_check_reads_the_ways_of_promising_one_negative_control(tmp_path):
    nb = tmp_path / "99_x.ipynb"
    cells = [{"cell_type": "markdown", "source": ["Runs in about a minute. Under a minute here, in a few minutes "
                                                  "there, in a minute or two elsewhere; 60 minutes of a run."]}]
    nb.write_text(json.dumps({"cells": cells}))
    assert minute_claims(nb) == ["about a minute", "Under a minute"]
