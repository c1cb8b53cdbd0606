"""The codebase's shape, checked: modules under 400 lines, functions under 60, the layers in one
strict order (docs/architecture.md draws it) with no import running back up, and imports inside
functions only where a heavy optional dependency is deferred."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "longt5_jax"
MODULES = sorted(PACKAGE.rglob("*.py"))
# Every package and top-level module, bottom to top: each may import only those before it. The
# library ends at `cli`; above it, the commands (each a `python -m longt5_jax.<name>`), and no
# library package holds one. A module belongs to the longest name here that prefixes it.
# The commands, in the order they may import each other (the doctor runs the planner's estimate).
COMMANDS = (
    "ckpt",
    "bench",
    "launch",
    "data_preview",
    "data_convert",
    "plan",
    "train",
    "evaluate",
    "predict",
    "demo",
    "doctor",
)
ORDER = (
    "errors",  # the error kinds every layer raises
    "kernels",  # fused attention kernels (Pallas), below the model that calls them
    "model",  # pure math with logical axis names
    "kernel_checks",  # the kernels' reference: a model layer each way, their errors
    "formats",  # checkpoint trees: native, Hugging Face, T5X; atomic writes
    "data",  # sources, tokenizer, objectives, batches
    "parallel",  # mesh, the rule table, shardings, pipeline, offload
    "infer",  # decoding, the generator, evaluation of a split, ROUGE
    "training",  # the step, optimizer, checkpoints, metrics, the loop and its Experiment
    "estimate",  # cost models, deviceless compiles, HLO reading
    "configuration",  # gin -> the Experiment
    "environment",  # XLA_FLAGS, JAX_PLATFORMS, cache variables, ports: checked at start-up
    "cli",  # the one boundary: errors -> one line and an exit status
    *COMMANDS,
)
# Third-party modules imported inside a function, each for a reason; nothing else is.
DEFERRED = {
    "torch": "the numerical reference (the test extra): only where a command compares with it",
    "transformers": "the numerical reference (the test extra), as torch",
    "safetensors": "read and written only by Hugging Face conversion",
    "tensorstore": "only to say why a damaged checkpoint's array cannot be read",
    "matplotlib": "a benchmark's PNG only; its import costs a second",
    "rouge_score": "pulls in nltk and scipy (1.6 s): only when ROUGE is asked for",
    "tensorboardX": "imported with torch hidden, which it would otherwise load (1.5 s)",
}


def _unit(dotted: str) -> str:
    """The ORDER entry a module of ours belongs to ('data.pipeline' -> 'data')."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ORDER:
            return ".".join(parts[:n])
    raise AssertionError(f"longt5_jax.{dotted} is in no layer of ORDER")


def _imports(tree: ast.Module) -> list[tuple[ast.AST, str]]:
    """(node, module) for each import in `tree`, ours relative to the package ('data.x')."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node, node.module)]
            package = PACKAGE.parent / node.module.replace(".", "/")
            if node.module.startswith("longt5_jax") and package.is_dir():
                found += [(node, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node, a.name) for a in node.names]
    return found


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")


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


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_runs_back_up_the_layers(path):
    if path == PACKAGE / "__init__.py":
        return
    here = ORDER.index(_unit(_dotted(path)))
    upward = sorted(
        {
            f"{module} ({_unit(module[len('longt5_jax.') :])})"
            for _, module in _imports(ast.parse(path.read_text()))
            if module.startswith("longt5_jax.")
            and ORDER.index(_unit(module[len("longt5_jax.") :])) > here
        }
    )
    assert not upward, f"{_dotted(path)} ({ORDER[here]}) imports from above it: {upward}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_library_packages_hold_no_command(path):
    """Below the commands nothing parses a command line or runs as `python -m` (cli, the
    boundary, holds the parser every command uses)."""
    if path == PACKAGE / "__init__.py" or ORDER.index(_unit(_dotted(path))) >= ORDER.index("cli"):
        return
    tree = ast.parse(path.read_text())
    found = [
        f"line {node.lineno}: {what}" for node in ast.walk(tree) for what in _command_parts(node)
    ]
    assert path.name != "__main__.py" and not found, f"{_dotted(path)} holds a command: {found}"


def _command_parts(node: ast.AST) -> list[str]:
    if isinstance(node, ast.FunctionDef) and node.name == "main":
        return ["def main"]
    if isinstance(node, ast.Attribute) and node.attr in ("ArgumentParser", "add_argument"):
        return [node.attr]
    if isinstance(node, ast.Constant) and node.value == "__main__":
        return ["__name__ == '__main__'"]
    return []


def test_order_covers_every_module_and_checks_itself():
    assert {_unit(_dotted(p)) for p in MODULES if p.name != "__init__.py" or p.parent != PACKAGE}
    with pytest.raises(AssertionError, match="in no layer"):
        _unit("nowhere.module")
    # An arrow back up is seen: the model importing training.
    tree = ast.parse("from longt5_jax.training.step import ShardedStep")
    ups = [m for _, m in _imports(tree) if ORDER.index(_unit(m[11:])) > ORDER.index("model")]
    assert ups == ["longt5_jax.training.step"]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_inside_functions_only_defer_heavy_optional_dependencies(path):
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    inner = {
        module.split(".")[0]
        for node, module in _imports(tree)
        if id(node) not in top and not _guarded_at_top(tree, node)
    }
    assert inner <= set(DEFERRED), (
        f"{_dotted(path)} imports inside a function: {inner - set(DEFERRED)}"
    )


def _guarded_at_top(tree: ast.Module, node: ast.AST) -> bool:
    """An import in a module-level `try:` (an optional dependency) is a top-level import."""
    return any(
        isinstance(t, ast.Try) and any(node is n for s in t.body for n in ast.walk(s))
        for t in tree.body
    )


def test_the_architecture_page_draws_the_order_the_test_holds():
    """docs/architecture.md's layer drawing lists the library's layers top-down in ORDER."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    drawing = page.split("## Layers", 1)[1].split("```")[1]
    drawn = [
        line.split()[0].removesuffix("/").removesuffix(".py").replace("/", ".")
        for line in drawing.splitlines()
        if line and not line[0].isspace()
    ]
    library = [u for u in ORDER[: ORDER.index("cli") + 1]]
    assert drawn == ["commands", *reversed(library)]
