"""Tests run on 8 fake CPU devices (set before jax starts) in float32.

Compile time dominates the suite, so tests compile cheaply (LLVM's optimisations off, and XLA's
older CPU emitters instead of its MLIR fusion emitters: a third of the compile time; the programs
are tiny, they run as fast either way) and share a persistent compilation cache, which every
process the tests start inherits: the same program compiled by another test, another process or
the slow run is read back instead (programs that took half a second or more to compile: the
many tiny eager ops would cost more to write than to compile).
"""

import collections
import gc
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
CHEAP_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
    """XLA aborts a process whose XLA_FLAGS holds a flag it does not know (a newer jaxlib may
    drop this one): ask a throwaway process first."""
    probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0


flags = os.environ.get("XLA_FLAGS", "")
if CHEAP_EMITTERS not in flags and _xla_knows(CHEAP_EMITTERS):  # test workers inherit it
    flags += " " + CHEAP_EMITTERS
os.environ["XLA_FLAGS"] = (
    flags + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
# With the gpu extra installed, its CUDA plugin would look for a driver at start-up (and print a
# traceback when none is there); the deviceless GPU compile needs none.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "xla")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# A test process traces and compiles hundreds of programs and keeps its files' fixtures alive:
# at Python's default thresholds (700, 10, 10) its collector ran often and scanned all of that
# each time, a share of every in-process test's time (docs/benchmarks.md, "The test suite").
# Tracing's garbage is mostly acyclic and freed by reference counts; the collector still runs.
gc.set_threshold(50_000, 20, 100)

import pytest  # noqa: E402

from longt5_jax.estimate import compile_ahead  # noqa: E402

# Each test process keeps the kernels of its deviceless GPU compiles under .pytest_cache, one
# directory per xdist worker, which the slow pass's worker of that name and later runs start
# from (warm, the default pass's GPU compile tests took 97 s where they took 153); a directory
# another live process holds is left to it (`keep_kernels_in`).
compile_ahead.keep_kernels_in(
    Path(__file__).resolve().parents[1]
    / ".pytest_cache"
    / "gpu_kernels"
    / os.environ.get("PYTEST_XDIST_WORKER", "main")
)

# Files whose tests share no fixture and each start processes, runs or compiles of their own.
SPREAD = {
    "test_elastic.py",
    "test_multihost.py",
    "test_offload.py",
    "test_train.py",
    "test_long_attention_kernel.py",
}


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """With several test processes (pytest-xdist, --dist=loadfile), a file's tests run in one of
    them, so its module fixtures (compiled steps, trained runs) are built once; the files in
    SPREAD are shared out test by test. (Marking groups for --dist=loadgroup does not reach the
    scheduler with this pytest.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Files(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if Path(path).name in SPREAD else path

    # Work is handed out in collection order (below): xdist's own, the files with most tests
    # first, would leave the single multi-minute runs for last and one process idle at the end.
    config.option.loadscopereorder = False
    return Files(config, log)


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(config, items):
    """The runs of SPREAD files first (each up to minutes), then the files holding slow tests
    (with them, `.ci/run`'s single pass: a slow test is one run or compile of minutes), then
    files by their number of tests, most first: the longest work starts first and the short
    files fill the end."""
    tests_in = collections.Counter(item.path for item in items)
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(
        key=lambda item: (item.path.name not in SPREAD, item.path not in slow, -tests_in[item.path])
    )
