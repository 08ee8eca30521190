"""Soak benchmark: many consumers over many jobs while workers are killed and restarted.

    python -m bench.soak [--minutes 10] [--jobs 8] [--consumers 4] [--workers 10]
                         [--kill-every 15] [--elements 20000] [--seed 0]

A broker (``--heartbeat 0.5``) and ``--workers`` single-process ``zloader-worker``s serve
``--jobs`` jobs. A worker serves one job at a time, so there are more workers than jobs (a
job left without one would wait). Each job is read by ``--consumers`` Loaders sharing its
``job_name`` (one consumer process per job, one thread per Loader), epoch after epoch, with
exactly-once dynamic sharding. The pipeline mixes splits and batches:
``range(elements, split_size=50).map(row).shuffle(400).batch(16)``. Every ``--kill-every``
seconds (jittered, seeded) a random worker gets SIGKILL and a new one starts.

Reported, for every epoch of every job (all its consumers together): elements delivered,
lost (must be 0) and duplicated (must be 0); the resident memory of the broker and of the
workers over the run (it must stay flat); and once all is closed, the file descriptors the
consumer processes leaked, the zloader segments left in /dev/shm, and stray processes (all
must be 0).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import psutil

from bench._common import version

BIN = pathlib.Path(sys.executable).parent
SAMPLE_SECONDS = 5.0


def _pipeline(elements: int) -> Any:
    from zloader import Pipeline

    def row(i: int) -> np.ndarray:
        return np.full(32, i, np.int64)

    return Pipeline.range(elements, split_size=50).map(row).shuffle(400).batch(16)


def _segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if "zloader" in name.lower()}


def consumer_process(address: str, job: int, consumers: int, elements: int, deadline: float,
                     results: Any) -> None:
    """One job's consumers, as threads; reports per epoch the delivery counts."""
    from zloader import Loader

    fds_before = len(os.listdir("/proc/self/fd"))
    pipeline = _pipeline(elements)
    loaders = [Loader(pipeline, broker=address, job_name=f"soak-{job}", timeout=60)
               for _ in range(consumers)]
    stop = threading.Event()
    tallies: list[dict[int, np.ndarray]] = [{} for _ in range(consumers)]
    errors: list[str] = []

    def decide() -> None:  # once per epoch, for all of this job's consumers
        if time.time() >= deadline:
            stop.set()

    barrier = threading.Barrier(consumers, action=decide)

    def read(index: int) -> None:
        epoch = 0
        try:
            while True:
                barrier.wait(timeout=600)
                if stop.is_set():
                    return
                counts = np.zeros(elements, np.int64)
                for batch in loaders[index]:
                    np.add.at(counts, np.asarray(batch)[:, 0], 1)
                tallies[index][epoch] = counts
                epoch += 1
        except Exception as exc:  # reported, and the others are let go
            errors.append(f"consumer {index}: {exc!r}")
            stop.set()
            barrier.abort()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(consumers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for loader in loaders:
        loader.close()
    time.sleep(0.5)
    epochs = []
    for epoch in sorted(set.intersection(*(set(t) for t in tallies)) if tallies else ()):
        counts = sum(t[epoch] for t in tallies)
        epochs.append({"job": job, "epoch": epoch, "delivered": int(counts.sum()),
                       "lost": int((counts == 0).sum()),
                       "duplicated": int(np.maximum(counts - 1, 0).sum())})
    results.put({"job": job, "epochs": epochs, "errors": errors,
                 "leaked_fds": len(os.listdir("/proc/self/fd")) - fds_before})


def _rss(process: psutil.Process) -> float:
    try:
        return process.memory_info().rss / 2**20
    except psutil.Error:
        return 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    segments_before = _segments()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    broker = subprocess.Popen([str(BIN / "zloader-broker"), "--bind", address,
                               "--heartbeat", "0.5", "--log-level", args.broker_log])
    workers = [subprocess.Popen([str(BIN / "zloader-worker"), "--broker", address,
                                 "--log-level", "error"]) for _ in range(args.workers)]
    start = time.time()
    deadline = start + args.minutes * 60
    results: Any = multiprocessing.get_context("fork").Queue()
    consumers = [multiprocessing.get_context("fork").Process(
        target=consumer_process, args=(address, job, args.consumers, args.elements, deadline,
                                       results)) for job in range(args.jobs)]
    for process in consumers:
        process.start()
    samples: list[dict[str, float]] = []
    kills = 0
    next_kill = start + args.kill_every * rng.uniform(0.5, 1.5)
    next_sample = start
    while any(p.is_alive() for p in consumers):
        now = time.time()
        if now >= next_sample:
            live = [psutil.Process(w.pid) for w in workers if w.poll() is None]
            samples.append({"t": round(now - start, 1), "broker_mib": _rss(psutil.Process(
                broker.pid)), "worker_mib": max((_rss(w) for w in live), default=0.0)})
            next_sample = now + SAMPLE_SECONDS
        if now >= next_kill and now < deadline:
            victim = rng.choice([w for w in workers if w.poll() is None])
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            workers.remove(victim)
            workers.append(subprocess.Popen([str(BIN / "zloader-worker"), "--broker",
                                             address, "--log-level", "error"]))
            kills += 1
            next_kill = now + args.kill_every * rng.uniform(0.5, 1.5)
        time.sleep(0.2)
    reports = [results.get(timeout=30) for _ in consumers]
    for process in consumers:
        process.join()
    for process in [*workers, broker]:
        process.send_signal(signal.SIGTERM)
    for process in [*workers, broker]:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    time.sleep(1.0)
    epochs = [e for r in reports for e in r["epochs"]]
    third = max(1, len(samples) // 3)
    return {
        "minutes": round((time.time() - start) / 60, 2), "jobs": args.jobs,
        "consumers": args.jobs * args.consumers, "workers": args.workers, "kills": kills,
        "elements_per_epoch": args.elements, "epochs": len(epochs),
        "delivered": sum(e["delivered"] for e in epochs),
        "lost": sum(e["lost"] for e in epochs),
        "duplicated": sum(e["duplicated"] for e in epochs),
        "errors": [e for r in reports for e in r["errors"]],
        "bad_epochs": [e for e in epochs if e["lost"] or e["duplicated"]],
        "broker_mib_first_third": round(max(s["broker_mib"] for s in samples[:third]), 1),
        "broker_mib_last_third": round(max(s["broker_mib"] for s in samples[-third:]), 1),
        "worker_mib_first_third": round(max(s["worker_mib"] for s in samples[:third]), 1),
        "worker_mib_last_third": round(max(s["worker_mib"] for s in samples[-third:]), 1),
        "leaked_fds": sum(r["leaked_fds"] for r in reports),
        "leaked_segments": len(_segments() - segments_before),
        "stray_processes": len(psutil.Process().children(recursive=True)),
        "samples": samples,
    }


def report(result: dict[str, Any]) -> str:
    ok = {True: "holds", False: "MISSED"}
    flat = (result["broker_mib_last_third"] <= 1.2 * result["broker_mib_first_third"] + 16
            and result["worker_mib_last_third"] <= 1.2 * result["worker_mib_first_third"] + 16)
    clean = not (result["leaked_fds"] or result["leaked_segments"]
                 or result["stray_processes"])
    lines = [
        f"Soak: {result['minutes']} min, {result['consumers']} consumers over "
        f"{result['jobs']} jobs (job_name, exactly-once dynamic sharding), "
        f"{result['workers']} workers, {result['kills']} worker SIGKILLs (each replaced), "
        f"nproc {os.cpu_count()}, numpy {version('numpy')}, pyzmq {version('pyzmq')}. "
        f"Pipeline: range({result['elements_per_epoch']}, split_size=50).map(row)"
        ".shuffle(400).batch(16).",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| epochs checked (job x epoch) | {result['epochs']} | |",
        f"| elements delivered | {result['delivered']:,} | |",
        f"| lost | {result['lost']} | 0: {ok[result['lost'] == 0]} |",
        f"| duplicated | {result['duplicated']} | 0: {ok[result['duplicated'] == 0]} |",
        f"| broker RSS, peak of first / last third (MiB) | {result['broker_mib_first_third']}"
        f" / {result['broker_mib_last_third']} | flat: {ok[flat]} |",
        f"| largest worker RSS, peak of first / last third (MiB) | "
        f"{result['worker_mib_first_third']} / {result['worker_mib_last_third']} | |",
        f"| leaked fds (consumer processes) | {result['leaked_fds']} | 0 |",
        f"| leaked /dev/shm segments | {result['leaked_segments']} | 0 |",
        f"| stray processes | {result['stray_processes']} | 0: {ok[clean]} |",
    ]
    if result["errors"]:
        lines += ["", "Errors: " + "; ".join(result["errors"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--consumers", type=int, default=4, help="per job")
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--kill-every", type=float, default=15.0, help="seconds, on average")
    parser.add_argument("--elements", type=int, default=20000, help="per epoch of each job")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--broker-log", default="error", help="the broker's --log-level")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    result = run(args)
    text = report(result)
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.md").write_text(text)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    failed = result["lost"] or result["duplicated"] or result["errors"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
