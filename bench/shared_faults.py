"""Shared jobs through moves, stops and deaths: does every trainer get its epoch exactly?

    python -m bench.shared_faults [--runs 3] [--out bench/results]

A broker and two ``zloader-worker`` processes; trainer ``a`` reads a shared job of 1,200
elements (4 ms each, splits of 20) with ``share=True``. Each run is one of:

- **move**: a second shared job (another pipeline, 600 elements) registers once ``a`` has
  100 elements: the pool moves one of the two workers to it mid-epoch (the sweep of
  issue 42, where trials start at different times); then trainer ``c`` of the first
  pipeline joins its epoch once the move is done;
- **sigterm**: one worker gets SIGTERM once ``a`` has 200 elements (a scale-down), then
  ``c`` joins;
- **sigkill**: one worker is SIGKILLed once ``a`` has 200 elements, then ``c`` joins.

Counts each trainer's elements repeated and lost against its epoch. Run it on another
checkout (``PYTHONPATH=that/checkout``) for the figures before a change. Writes
``shared_faults.json`` and ``shared_faults.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from bench._common import free_port, provenance, stop
from zloader import Loader, Pipeline
from zloader._status import fetch_status

N, OTHER = 1200, 600
FAULTS = ("move", "sigterm", "sigkill")
BIN = pathlib.Path(sys.executable).parent


def slow(x: int) -> int:
    time.sleep(0.004)
    return x


def _status(address: str) -> dict[str, Any]:
    try:
        return fetch_status(address, None, 2.0)
    except Exception:  # (not up yet)
        return {}


def _wait(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not get where it waits for")
        time.sleep(0.02)


def one(fault: str) -> dict[str, Any]:
    """One run: each trainer's elements repeated and lost."""
    address = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    broker = subprocess.Popen([str(BIN / "zloader-broker"), "--bind", address,
                               "--heartbeat", "0.5", "--log-level", "error"], env=env)
    workers = [subprocess.Popen([str(BIN / "zloader-worker"), "--broker", address], env=env)
               for _ in range(2)]
    first = Pipeline.range(N, split_size=20).map(slow)
    second = Pipeline.range(OTHER, split_size=20).map(slow)
    got: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def jobs() -> dict[str, int]:
        return {j["fingerprint"]: j["workers"] for j in _status(address).get("jobs", ())}

    def read(name: str, pipeline: Pipeline) -> None:
        try:
            if name == "b":
                _wait(lambda: len(got.get("a", ())) >= 100)
            elif name == "c" and fault == "move":
                _wait(lambda: jobs().get(second.fingerprint) == 1
                      and jobs().get(first.fingerprint) == 1)
            elif name == "c":
                _wait(lambda: len(got.get("a", ())) >= 200)
                workers[0].send_signal(signal.SIGTERM if fault == "sigterm" else signal.SIGKILL)
                workers[0].wait(30)
            got[name] = []
            with Loader(pipeline, broker=address, share=True, timeout=60) as loader:
                got[name].extend(int(x) for x in loader)
        except BaseException as exc:  # reported in the table
            errors.append(exc)

    try:
        _wait(lambda: len(_status(address).get("workers", ())) == 2)
        readers = [("a", first), ("c", first)] + ([("b", second)] if fault == "move" else [])
        threads = [threading.Thread(target=read, args=r, daemon=True) for r in readers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        stop([*workers, broker], 10)
    out: dict[str, Any] = {"fault": fault, "errors": [repr(e)[:200] for e in errors]}
    for name, size in (("a", N), ("c", N), ("b", OTHER)):
        if name not in got:
            continue
        counts = collections.Counter(got[name])
        out[name] = {"got": len(got[name]),
                     "repeated": sum(n - 1 for n in counts.values()),
                     "lost": len(set(range(size)) - set(counts))}
    return out


def _cell(runs: list[dict[str, Any]], name: str) -> str:
    return ", ".join(f"{r[name]['repeated']} / {r[name]['lost']}" if name in r else "failed"
                     for r in runs)


def _exact(run: dict[str, Any]) -> bool:
    names = ("a", "c", "b") if run["fault"] == "move" else ("a", "c")
    return not run["errors"] and all(
        name in run and run[name]["repeated"] == 0 and run[name]["lost"] == 0
        for name in names)


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| fault | runs | trainer a: repeated / lost (per run) | late trainer c: repeated / "
            "lost (per run) | exact runs |", "|---|---|---|---|---|"]
    for fault in FAULTS:
        runs = [r for r in results if r["fault"] == fault]
        if runs:
            rows.append(f"| {fault} | {len(runs)} | {_cell(runs, 'a')} | {_cell(runs, 'c')} | "
                        f"{sum(map(_exact, runs))} of {len(runs)} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    results = [one(fault) for _ in range(args.runs) for fault in args.faults.split(",")]
    for result in results:
        print(json.dumps(result), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shared_faults.json").write_text(json.dumps(
        {"provenance": provenance(), "results": results}, indent=1) + "\n")
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = provenance()["commit"][:10]
    text = (f"# Shared jobs through moves, stops and deaths\n\n`python -m bench.shared_faults"
            f" --runs {args.runs}` ({when}, commit {commit}): two workers, a shared job of "
            f"{N:,} elements read by trainer a, a fault mid-epoch, then trainer c joins the "
            "epoch.\n\n" + table(results) + "\n")
    (out / "shared_faults.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
