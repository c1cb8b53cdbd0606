"""Several training processes on this machine, as a multi-host run would have them.

    python -m longt5_jax.launch.local --num_processes 2 --devices_per_process 4 -- \\
        --gin_file=configs/demo.gin --gin.MODEL_DIR="'/tmp/demo2'"

Each process is `python -m longt5_jax.train <arguments>` with K fake CPU devices, joined over
127.0.0.1 (gloo collectives). Output lines carry `[i/N]` (stdout to stdout, stderr to
stderr); SIGINT and SIGTERM go to every
process; if one fails the others are stopped, and the launcher exits with the first failure's
status (0 when all succeed).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from longt5_jax import cli
from longt5_jax.errors import UsageError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relay(lines, out, prefix: str, lock: threading.Lock) -> None:
    """A process's stdout or stderr line by line to ours, each line prefixed."""
    for line in lines:
        with lock:
            out.write(prefix + line)
            out.flush()


def _watch(procs: list[subprocess.Popen], lock: threading.Lock, grace_s: float) -> int:
    """Wait for the processes; at the first failure stop the others (SIGTERM, then SIGKILL
    after `grace_s`). Returns the first failure's status, 0 if none failed."""
    status = 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed and not status:
            status = failed[0].returncode
            # Exits 1 and 2 have said why in one line of their own; anything else (a signal, a
            # crash) has not.
            with lock:
                if status not in (1, 2):
                    print(
                        f"[launcher] process {procs.index(failed[0])} exited with {status}; "
                        "stopping the others",
                        file=sys.stderr,
                        flush=True,
                    )
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.1)
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    return status


def launch(num_processes: int, devices_per_process: int, train_args: list[str], grace_s=10.0,
           module: str = "longt5_jax.train"):  # fmt: skip
    """Run the processes of `module` (train, or the doctor checking the run) to the end;
    returns the exit status."""
    port = free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "LONGT5_JAX_PREFIXED": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env["XLA_FLAGS"] = cli.xla_flags_for_child()  # the device count is each process's own
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                *train_args,
                f"--gin.RunConfig.cpu_devices={devices_per_process}",
                f"--coordinator_address=127.0.0.1:{port}",
                f"--num_processes={num_processes}",
                f"--process_id={i}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(num_processes)
    ]
    lock = threading.Lock()
    relays = [
        threading.Thread(
            target=_relay, args=(lines, out, f"[{i}/{num_processes}] ", lock), daemon=True
        )
        for i, p in enumerate(procs)
        for lines, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))
    ]
    for t in relays:
        t.start()

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    status = _watch(procs, lock, grace_s)
    for t in relays:
        t.join(timeout=5)
    codes = [p.returncode for p in procs]
    return status or next((c for c in codes if c), 0)


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    ours, train_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = cli.ArgumentParser(prog="python -m longt5_jax.launch.local", description=__doc__)
    parser.add_argument("--num_processes", type=cli.positive, default=2)
    parser.add_argument("--devices_per_process", type=cli.positive, default=4)
    parser.add_argument(
        "--command", choices=("train", "doctor"), default="train", help="doctor: check the run"
    )
    args = parser.parse_args(ours)
    if not train_args:
        raise UsageError("no training arguments: put them after `--`")
    module = f"longt5_jax.{args.command}"
    code = launch(args.num_processes, args.devices_per_process, train_args, module=module)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


if __name__ == "__main__":
    sys.exit(main())
