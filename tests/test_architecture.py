"""The layering docs/architecture.md describes, held by the code: imports only go down the layers, no module imports
another package's private name, no import circle between modules, and no source file is over the size limit.

Read with ``ast`` from the files themselves (imports inside functions included), so a lazy import cannot hide a
layer violation.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compiler", "calibration")
# each layer may import itself and the layers before it (compiler.cli and compiler/__init__ sit on top)
LAYERS = [
    ("compiler.core",),
    ("compiler.backends",),
    ("compiler.frontend", "calibration"),
    ("compiler.serve", "compiler.pipeline", "compiler.bench", "compiler.diagnose"),
    ("compiler.cli", "compiler"),
]
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import in the file, absolute or relative."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return [(module, names) for module, names in found if module.split(".")[0] in PACKAGES]


def _layer(module: str) -> int:
    best, index = -1, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, index = len(name), i
    assert index >= 0, f"{module} is in no layer of LAYERS: add it there and to docs/architecture.md"
    return index


def _package(module: str) -> str:
    """The package a module belongs to for the private-name rule: compiler.X or calibration."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "compiler" and len(parts) > 1 else parts[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _target(module: str, name: str) -> str:
    """``from module import name``: the module imported when ``name`` is a module, else ``module``."""
    return f"{module}.{name}" if f"{module}.{name}" in MODULES else module


def test_imports_only_go_down_the_layers() -> None:
    upward = []
    for module, path in MODULES.items():
        for imported, names in _imports(path):
            for target in [_target(imported, n) for n in names] or [imported]:
                if _layer(target) > _layer(module):
                    upward.append(f"{module} imports {target}")
    assert upward == []


def test_no_private_name_is_imported_from_another_package() -> None:
    private = []
    for module, path in MODULES.items():
        for imported, names in _imports(path):
            for name in names:
                target = _target(imported, name)
                crosses = _package(target) != _package(module)
                if crosses and (_private(name) or any(_private(p) for p in target.split("."))):
                    private.append(f"{module} imports {imported}.{name}")
    assert private == []


def test_no_import_circle_between_modules() -> None:
    graph = {module: set() for module in MODULES}
    for module, path in MODULES.items():
        for imported, names in _imports(path):
            for target in [_target(imported, n) for n in names] or [imported]:
                if target in graph and target != module and not module.startswith(target + "."):
                    graph[module].add(target)
    state: dict[str, int] = {}
    circles = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(" -> ".join([*trail[trail.index(target):], target]))
            elif target not in state:
                visit(target, [*trail, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


@pytest.mark.parametrize("root", ["compiler", "calibration", "tests", "benchmarks", "examples"])
def test_no_source_file_is_over_the_size_limit(root: str) -> None:
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / root).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
