"""The package's layout: no import circle anywhere in accelhelpers, and the commands (accelhelpers/commands/) sit on
top: no notebook and no module below them imports or names them (accelhelpers/__main__.py, the CLI, runs them)."""

import ast
import json
import re
from pathlib import Path

import pytest

from tools import nbexport

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "accelhelpers"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
COMMANDS = "accelhelpers.commands"


def module_names(package: Path) -> dict[str, Path]:
    """Every module of the package by its dotted name (an __init__.py names its package)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _within(name: str, known: set[str]) -> str | None:
    """The longest known module that `name` (a module, or a name inside one) lies in."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in known:
            return ".".join(parts[:i])
    return None


def _chain(node: ast.Attribute) -> str | None:
    """`ah.commands.course` as 'ah.commands.course'; None where the chain does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def imported(source: str, module: str | None, known: set[str], root: str, is_package: bool = False) -> set[str]:
    """The package's modules that `source` imports, at module level or inside functions: `import root.x`,
    `from root.x import y`, `from . import x`, `from ..x import y` (relative to `module`); `import root as ah`
    counts as the modules its `ah.<module>` attribute uses name (the package itself where they name none)."""
    tree = ast.parse(source)
    here = module if is_package else (module or "").rpartition(".")[0]
    aliases, found = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == root or a.name.startswith(root + "."):
                    if a.name != root:
                        found.add(_within(a.name, known) or a.name)
                    if a.asname is None or a.name == root:
                        aliases.add(a.asname or root)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if module is None:
                    continue
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != root and not target.startswith(root + "."):
                continue
            for a in node.names:
                found.add(_within(f"{target}.{a.name}", known) or _within(target, known) or target)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (chain := _chain(node)) and chain.split(".")[0] in aliases:
            found.add(_within(root + chain[len(chain.split(".")[0]):], known) or root)
    return found - {module}


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module -> the package's modules it imports, and the packages those live in (whose __init__ runs
    first)."""
    names = module_names(package)
    known = set(names)
    graph = {}
    for name, path in names.items():
        targets = imported(path.read_text(), name, known, package.name, path.name == "__init__.py")
        with_parents = {".".join(t.split(".")[:i]) for t in targets for i in range(1, t.count(".") + 2)}
        graph[name] = (with_parents & known) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def commands_references(source: str, module: str | None = None, is_package: bool = False) -> list[str]:
    """Where `source` imports or names accelhelpers.commands: imports, `ah.commands...`, module-name strings."""
    known = set(module_names(PACKAGE))
    refs = {t for t in imported(source, module, known, "accelhelpers", is_package)
            if t == COMMANDS or t.startswith(COMMANDS + ".")}
    refs |= {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and re.fullmatch(re.escape(COMMANDS) + r"(\.\w+)*", n.value)}
    return sorted(refs)


def _code(nb: Path) -> str:
    """A notebook's code cells, IPython magics and shell lines removed so that `ast` can read them."""
    cells = json.loads(nb.read_text())["cells"]
    return "\n".join(nbexport.python_of("".join(c["source"])) for c in cells if c["cell_type"] == "code")


# --- the package --------------------------------------------------------------------------------------------------


def test_accelhelpers_has_no_import_circle():
    graph = import_graph(PACKAGE)
    # the graph sees what it must: imports at module level, inside functions, and through `ah.<module>`
    assert {"accelhelpers.udlbook", "accelhelpers.commands"} <= graph["accelhelpers.commands.reproduce"]
    assert {"accelhelpers.commands.course", "accelhelpers.commands.bench"} <= graph["accelhelpers.__main__"]
    assert "accelhelpers.udlbook" in graph["accelhelpers.commands.course"]  # inside readme_tables
    # importing the package imports nothing else, but for the notebook's cells in a process it launched (cells.py)
    assert graph["accelhelpers"] == {"accelhelpers.cells"}
    assert graph["accelhelpers.cells"] == set()
    circles = []
    while cycle := find_cycle(graph):  # name every circle, not only the first: drop each one's closing edge
        circles.append(" -> ".join(cycle))
        graph[cycle[-2]].discard(cycle[-1])
    assert circles == [], "import circles: " + "; ".join(circles)


@pytest.mark.slow
def test_no_notebook_and_no_module_below_the_commands_uses_them():
    found = {}
    for name, path in module_names(PACKAGE).items():
        if name == "accelhelpers.__main__" or name == COMMANDS or name.startswith(COMMANDS + "."):
            continue
        if refs := commands_references(path.read_text(), name, path.name == "__init__.py"):
            found[str(path.relative_to(ROOT))] = refs
    for nb in NOTEBOOKS:
        if refs := commands_references(_code(nb)):
            found[nb.name] = refs
    assert NOTEBOOKS and found == {}


# --- the checks catch what they look for ---------------------------------------------------------------------------


def _package(tmp_path: Path, c_source: str) -> Path:
    """pkg/: a imports b at module level, b imports sub.c inside a function, sub.c is `c_source`."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import g\n    return g\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text(c_source)
    return pkg


def test_the_circle_check_finds_a_circle_through_a_function_import_and_an_alias(tmp_path):
    graph = import_graph(_package(tmp_path, "import pkg as p\n\n\ndef g():\n    return p.a.x\n"))
    assert graph["pkg.a"] == {"pkg", "pkg.b"} and graph["pkg.b"] == {"pkg", "pkg.sub", "pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg", "pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    # `import pkg as p` alone is no edge to the modules: only what `p.<module>` names
    graph = import_graph(_package(tmp_path / "2", "import pkg as p\n\n\ndef g():\n    return p.__name__\n"))
    assert graph["pkg.sub.c"] == {"pkg"} and find_cycle(graph) is None
    # a sub-package's __init__ runs before its modules: a circle through it counts
    pkg = _package(tmp_path / "3", "X = 1\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import a\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.a", "pkg.b", "pkg.sub", "pkg.a"]


def test_the_commands_check_finds_each_way_of_reaching_them():
    bad = {"import accelhelpers as ah\nah.commands.course.run('quick')": [COMMANDS, "accelhelpers.commands.course"],
           "import accelhelpers as ah\nerr = ah.commands.CommandError": ["accelhelpers.commands"],
           "from accelhelpers.commands import course": ["accelhelpers.commands.course"],
           "from accelhelpers import commands": ["accelhelpers.commands"],
           "import accelhelpers.commands.bench": ["accelhelpers.commands.bench"],
           "def f():\n    from accelhelpers.commands.reproduce import main": ["accelhelpers.commands.reproduce"],
           "import importlib\nimportlib.import_module('accelhelpers.commands')": ["accelhelpers.commands"]}
    for source, refs in bad.items():
        assert commands_references(source) == refs, source
    assert commands_references("from .commands import CommandError", "accelhelpers.udlbook") == [COMMANDS]
    assert commands_references("from ..commands import course", "accelhelpers.sub.x") == [COMMANDS + ".course"]
    good = ["import accelhelpers as ah\nah.udlbook.recorded()\nprint('the course commands')",
            "from .results import repo_root", "import accelhelpers as ah\nah.session.setup('02')"]
    assert [commands_references(s, "accelhelpers.udlbook") for s in good] == [[], [], []]


def test_every_object_has_one_name_under_ah():
    """`ah.<module>.<name>` is the only way a notebook reaches the package, so a function or class defined in one module
    and reachable as a public name of another is a second name for one object (an alias the reader must learn is the
    same thing). A module that uses another's definition imports the module, or the name with a leading underscore."""
    import importlib
    import inspect
    import pkgutil

    import accelhelpers as ah

    aliases = []
    for info in pkgutil.iter_modules(ah.__path__):
        if info.ispkg or info.name.startswith("_"):
            continue  # the commands sub-package is the CLI's, not reached as ah.<module>
        module = importlib.import_module(f"accelhelpers.{info.name}")
        for name, obj in vars(module).items():
            home = getattr(obj, "__module__", "") or ""
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)) \
                    and home.startswith("accelhelpers.") and home != module.__name__:
                aliases.append(f"ah.{info.name}.{name} is {home.replace('accelhelpers', 'ah')}.{obj.__qualname__}")
    assert not aliases, "second names: " + "; ".join(aliases)


def test_the_package_docstring_draws_the_real_import_order():
    """accelhelpers/__init__.py's table: every module on its line, with the chapter it is exported from and exactly
    the package modules it imports, each of them on an earlier line; a `*` on exactly the imports that reach a later
    chapter's module from the floor or from an earlier chapter."""
    import accelhelpers

    rows = {}
    lines: list[str] = []
    for line in accelhelpers.__doc__.split("    module     chapter  imports\n", 1)[1].splitlines():
        if not line.startswith("    ") or not line.strip():
            break
        if line.startswith(" " * 24) and lines:  # a row's imports continued on the next line
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    for line in lines:
        name, chapter, *rest = line.split(maxsplit=2)
        imports = rest[0].split("  (")[0] if rest else ""
        rows[name] = (chapter, [i.strip() for i in imports.split(",") if i.strip()])
    graph = import_graph(PACKAGE)
    exported = {m: p.name[:2] for p in nbexport.chapters() for m in re.findall(r"#\| default_exp (\w+)", p.read_text())}
    real = {k.removeprefix("accelhelpers."): {v.removeprefix("accelhelpers.") for v in vs
                                              if v.startswith("accelhelpers.") and ".commands" not in v}
            for k, vs in graph.items() if k.startswith("accelhelpers.") and ".commands" not in k
            and k != "accelhelpers.__main__"}
    assert set(rows) == set(real), f"modules drawn {sorted(rows)} but the package has {sorted(real)}"
    order = list(rows)
    for name, (chapter, imports) in rows.items():
        where = exported.get(name, "floor")
        assert chapter == where, f"{name} is drawn as {chapter}, exported from {where}"
        plain = {i.rstrip("*") for i in imports}
        assert plain == real[name], f"{name} is drawn importing {sorted(plain)}, imports {sorted(real[name])}"
        for imp in imports:
            dep = imp.rstrip("*")
            assert order.index(dep) < order.index(name), f"{name} imports {dep}, drawn below it"
            later = dep in exported and (chapter == "floor" or exported[dep] > chapter)
            assert imp.endswith("*") == later, f"{name} -> {dep}: a * marks exactly a use of a later chapter"


def test_every_cell_id_has_one_style():
    """Cell ids are 8 hexadecimal digits (what JupyterLab and nbformat write), unique in their notebook: nbdev names
    each exported cell by its id in the module it writes."""
    bad = {}
    for nb in nbexport.chapters():
        ids = [c.get("id", "") for c in json.loads(nb.read_text())["cells"]]
        wrong = [i for i in ids if not re.fullmatch(r"[0-9a-f]{8}", i)]
        if wrong or len(set(ids)) != len(ids):
            bad[nb.name] = wrong or "repeated ids"
    assert not bad, f"cell ids of another style, or repeated: {bad}"
