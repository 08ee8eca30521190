"""Record the starvation traces the autoscaler tests replay (tests/test_autoscale.py).

For each workload and each worker count from 1 to 4, a broker and that many workers serve
one consumer for ``--seconds``; the broker's per-heartbeat starvation (the share of the
interval the consumer waited for data, as ``zloader status`` shows it) is recorded. Two
workloads:

- ``io``: each element takes a worker 5 ms asleep (a remote read); the consumer spends
  2 ms on each. Three workers keep up; more add nothing.
- ``cpu``: each element takes a worker 4 ms of CPU; the consumer spends 1 ms asleep. On
  this 2-core machine the third and fourth workers share cores with the others.

Run: ``python -m bench.autoscale_trace`` (about 2 minutes); it writes
``tests/data/autoscale_traces.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
from typing import Any

from bench._common import free_port, stop
from zloader import Loader, Pipeline
from zloader._status import Unanswered, fetch_status

BIN = os.path.dirname(sys.executable)
OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "autoscale_traces.json"
HEARTBEAT = 0.5


def io_work(x: int) -> int:
    time.sleep(0.005)
    return x


def cpu_work(x: int) -> int:
    end = time.thread_time() + 0.004
    while time.thread_time() < end:
        pass
    return x


WORKLOADS = {"io": (io_work, 0.002), "cpu": (cpu_work, 0.001)}


def record(workload: str, workers: int, seconds: float) -> list[float]:
    work, pause = WORKLOADS[workload]
    address = f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([os.path.join(BIN, "zloader-broker"), "--bind", address,
                               "--heartbeat", str(HEARTBEAT), "--log-level", "error"])
    pool = subprocess.Popen([os.path.join(BIN, "zloader-worker"), "--broker", address,
                             "--processes", str(workers)])
    samples: list[float] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if len(fetch_status(address, None, 1.0)["workers"]) == workers:
                    break
            except Unanswered:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not register")
            time.sleep(0.1)
        done = threading.Event()

        def watch() -> None:
            time.sleep(3.0)  # warm-up: the pipeline fills and the first reports arrive
            while not done.wait(HEARTBEAT):
                jobs = fetch_status(address, None, 2.0)["jobs"]
                if jobs:
                    samples.append(round(float(jobs[0]["starvation"]), 4))

        watcher = threading.Thread(target=watch)
        watcher.start()
        end = time.monotonic() + 3.0 + seconds
        with Loader(Pipeline.range(10**7, split_size=50).map(work), broker=address,
                    timeout=30) as loader:
            for _ in loader:
                time.sleep(pause)
                if time.monotonic() > end:
                    break
        done.set()
        watcher.join()
    finally:
        stop([pool, broker], 40)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="recorded per count")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    traces: dict[str, Any] = {"heartbeat": HEARTBEAT, "cores": os.cpu_count(),
                              "recorded": time.strftime("%Y-%m-%d"), "workloads": {}}
    for workload in WORKLOADS:
        traces["workloads"][workload] = {}
        for workers in range(1, 5):
            samples = record(workload, workers, args.seconds)
            traces["workloads"][workload][str(workers)] = samples
            mean = sum(samples) / max(1, len(samples))
            print(f"{workload} {workers} workers: {len(samples)} samples, starvation mean "
                  f"{mean:.3f}", flush=True)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(traces, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
