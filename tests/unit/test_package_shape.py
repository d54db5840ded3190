"""The package's shape as docs/architecture.md promises it: no import circle, small modules, and a tree that names
every module (and no module that is gone)."""

import re
from pathlib import Path

import grimp
import networkx

PACKAGE = Path(__file__).resolve().parents[2] / "mpiscale"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
LONGEST = 450  # lines a module may have


def _modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if path.name != "__init__.py")


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("mpiscale")
    edges = networkx.DiGraph(
        (module, imported) for module in graph.modules for imported in graph.find_modules_directly_imported_by(module)
    )
    assert [sorted(circle) for circle in networkx.strongly_connected_components(edges) if len(circle) > 1] == []


def test_no_module_is_longer_than_the_limit():
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in _modules()}
    assert {name: lines for name, lines in lengths.items() if lines > LONGEST} == {}


def _tree() -> str:
    text = ARCHITECTURE.read_text()
    return text.split("## The tree", 1)[1].split("```")[1]


def test_the_architecture_tree_names_every_module():
    tree = _tree()
    directories = set(re.findall(r"^(mpiscale/[\w/]+/)", tree, re.MULTILINE))
    missing = []
    for path in _modules():
        relative = path.relative_to(PACKAGE.parent).as_posix()
        folder = relative.rsplit("/", 1)[0] + "/"
        named = relative in tree or f"{folder}*.py" in tree
        named |= folder in directories and re.search(rf"\b{re.escape(path.name)}\b", tree) is not None
        if not named:
            missing.append(relative)
    assert missing == []


def test_the_architecture_tree_names_no_module_that_is_gone():
    named = re.findall(r"(mpiscale/[\w/]+\.py)", _tree())
    assert named and [path for path in named if not (PACKAGE.parent / path).is_file()] == []
