"""Run many commands (`python -m MODULE ARGS...`) each in a process of its own, forked from one
that has imported their modules once: the start-up (Python and jax imports, about 3 s of CPU a
command) is paid once, not per command, and each command still runs as `python -m` runs it (its
own process, `__main__`, file descriptors 1 and 2, exit status, atexit handlers). Nothing is
initialised before the fork but imports (no jax backend, no thread of Python's).

Run as `python tests/forkrun.py PLAN.json` by `helpers.run_forked`, which writes the plan (each
command's argv and where its output goes) and reads the exit statuses this prints.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import os
import runpy
import sys
import traceback
from pathlib import Path


def _child(argv: list[str], out: str, err: str) -> None:
    """Become `python -m argv[0] argv[1:]`; never returns."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    code = 0
    try:
        sys.argv = list(argv)
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter reads it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    for module in dict.fromkeys(p["argv"][0] for p in plan):
        # What the command imports, not the command itself: `python -m` runs it as __main__
        # only, and runpy warns of a module it is asked to run that is already imported.
        main = importlib.util.find_spec(module).submodule_search_locations
        target = f"{module}.__main__" if main else module
        importlib.import_module(target)
        sys.modules.pop(target)
    sys.stdout.flush()
    pids = []
    for p in plan:
        pid = os.fork()
        if pid == 0:
            _child(p["argv"], p["out"], p["err"])
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    print(json.dumps(codes))


if __name__ == "__main__":
    _main(sys.argv[1])
