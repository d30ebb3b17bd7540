"""The worker scripts a chapter writes with `%%writefile` cells, written out for a test to launch: the tests run
the code the learner reads and edits in the notebook, not a second copy."""

from __future__ import annotations

import json
import re
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
WRITEFILE = re.compile(r"^%%writefile\s+(?:-a\s+)?(\S+)\s*$")


def worker_cells(chapter: str) -> dict[str, str]:
    """{file name: source} of every `%%writefile <folder>/<name>` cell of chapter `chapter` ('06'), in order."""
    nb_path = next(NOTEBOOKS.glob(f"{chapter}_*.ipynb"))
    cells: dict[str, str] = {}
    for cell in json.loads(nb_path.read_text())["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        first, _, body = src.partition("\n")
        m = WRITEFILE.match(first) if cell["cell_type"] == "code" else None
        if m:
            name = m.group(1).replace("\\", "/").rsplit("/", 1)[-1].strip("'\"")
            cells[name] = body if body.endswith("\n") else body + "\n"
    if not cells:
        raise LookupError(f"{nb_path.name} has no %%writefile cell")
    return cells


def write_workers(chapter: str, folder: Path) -> dict[str, Path]:
    """Write chapter `chapter`'s worker scripts into `folder` (as its `%%writefile` cells do); {name: path}."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, src in worker_cells(chapter).items():
        paths[name] = folder / name
        paths[name].write_text(src)
    return paths
