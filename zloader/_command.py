"""The command line of one ``zloader-worker`` process, written once for the three places
that start one: a Loader's spawned workers, the children of ``zloader-worker --processes
N`` or ``--autoscale``, and a worker that replaces its wedged self (``os.execve``)."""

from __future__ import annotations

import os
import sys

__all__ = ["RUN_WORKER", "with_sys_path", "worker_command"]

RUN_WORKER = "import sys; from zloader.cli import worker_main; sys.exit(worker_main())"


def worker_command(broker: str, *, bind: str | None = None, parent: int | None = None,
                   advertise: str | None = None, keys: str | None = None,
                   insecure: bool = False, plain_data: bool = False,
                   blob_dir: str | None = None, log_level: str | None = None) -> list[str]:
    """``python -c RUN_WORKER --broker BROKER ...`` with the options given."""
    command = [sys.executable, "-c", RUN_WORKER, "--broker", broker]
    for flag, value in (("--bind", bind), ("--parent", parent), ("--advertise", advertise),
                        ("--keys", keys), ("--blob-dir", blob_dir),
                        ("--log-level", log_level)):
        if value is not None and value != "":
            command += [flag, str(value)]
    if insecure:
        command.append("--insecure")
    if plain_data:
        command.append("--plain-data")
    return command


def with_sys_path() -> dict[str, str]:
    """This process's environment, with its ``sys.path`` as ``PYTHONPATH``: a fresh
    interpreter then imports what this one does (the user's modules included)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env
