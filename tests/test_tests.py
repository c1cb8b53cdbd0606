"""The tests' own shape, checked: a test module imports no other test module (what tests share is
in `helpers`, or a conftest fixture), and only the bench tests import the bench commands (what
bench and the other tests both need lives in the library)."""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
MODULES = sorted(TESTS.glob("*.py"))
SHARED = "helpers"  # the one module every test may import


def _imported(tree: ast.Module) -> set[str]:
    """The dotted names of every module `tree` imports, at any depth (functions included)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found


def broken_rules(name: str, source: str, test_modules: set[str]) -> list[str]:
    """What the module `name` (a file name in tests/) breaks of the two rules, given the names
    of the modules in tests/."""
    imported = _imported(ast.parse(source))
    tops = {m.split(".")[0] for m in imported}
    others = sorted(tops & (test_modules - {SHARED, Path(name).stem}))
    broken = [f"{name} imports the test module {m}" for m in others]
    bench = sorted(
        m for m in imported if m == "longt5_jax.bench" or m.startswith("longt5_jax.bench.")
    )
    if bench and not name.startswith("test_bench"):
        broken.append(f"{name} imports {bench[0]}, which only tests/test_bench*.py may")
    return broken


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_test_modules_share_only_helpers_and_only_bench_tests_import_bench(path):
    assert broken_rules(path.name, path.read_text(), {p.stem for p in MODULES}) == []


def test_the_checker_sees_each_rule_broken():
    modules = {"helpers", "conftest", "forkrun", "test_step", "test_train"}
    ok = "import pytest\nfrom helpers import TINY_RUN\nfrom longt5_jax.bench_free import x\n"
    assert broken_rules("test_x.py", ok, modules) == []
    assert broken_rules("test_x.py", "from test_step import _batches\n", modules) == [
        "test_x.py imports the test module test_step"
    ]
    inside = "def f():\n    import forkrun\n    from conftest import SPREAD\n"
    assert broken_rules("test_x.py", inside, modules) == [
        "test_x.py imports the test module conftest",
        "test_x.py imports the test module forkrun",
    ]
    for bench in ("from longt5_jax.bench import kernels", "from longt5_jax import bench"):
        assert broken_rules("test_x.py", bench, modules) == [
            "test_x.py imports longt5_jax.bench, which only tests/test_bench*.py may"
        ]
    deep = "from longt5_jax.bench.device import parse_launch"
    assert broken_rules("test_x.py", deep, modules) == [
        "test_x.py imports longt5_jax.bench.device, which only tests/test_bench*.py may"
    ]
    assert broken_rules("test_bench_x.py", deep, modules) == []
    assert broken_rules("helpers.py", deep, modules) != []
