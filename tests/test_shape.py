"""The codebase's shape, checked: modules under 400 lines, functions under 60, and packages that
import only what the README's Architecture section says they may."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "longt5_jax"
MODULES = sorted(PACKAGE.rglob("*.py"))
# Each package with the packages of ours it may import (besides itself and the boundary).
# Commands filed in a package (data.preview, data.convert) may import anything.
LAYERS = {
    "model": set(),
    "formats": {"model"},
    "data": {"formats"},
    "parallel": {"model"},
    # The loop runs periodic eval, writes the operative config and counts FLOPs for MFU;
    # inference evaluates with the step's loss.
    "training": {"model", "formats", "data", "parallel", "infer", "plan", "configuration"},
    "infer": {"model", "formats", "data", "parallel", "training"},
}


def _ours(tree: ast.Module) -> set[str]:
    """The top-level names of ours a module imports (`longt5_jax.model.x` -> 'model')."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "longt5_jax":
                found |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("longt5_jax.")}
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_are_short(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 400, f"{path.name}: {len(text.splitlines())} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long, f"{path.name}: {long}"


@pytest.mark.parametrize("package", LAYERS)
def test_packages_import_only_the_layers_above_them(package):
    for path in sorted((PACKAGE / package).rglob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            continue
        imported = _ours(tree) - {package, "cli"}
        assert imported <= LAYERS[package], f"{path.relative_to(PACKAGE)} imports {imported}"
