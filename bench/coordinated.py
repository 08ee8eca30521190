"""Coordinated-reads benchmark: simulated synchronous training over variable-length inputs.

    python -m bench.coordinated [--consumers 4] [--workers 2] [--steps 200] [--repeats 3]

Four consumer processes (the replicas of a synchronous data-parallel run) read one job of a
zloader broker served by ``zloader-worker --processes W``. Each step a consumer takes its
next batch, sleeps 1 us per padded token of it (``batch.shape[0] * batch.shape[1]``; a
sleep, not a busy loop, so that 4 consumers on 2 cores do not serialise), then all meet at a
barrier: a step lasts as long as its longest batch, as with an all-reduce.

Input: sequences whose lengths are log-normal (mu 5, sigma 0.9, clipped to [8, 2048]),
``bucket_by_length`` with boundaries [64, 128, 256, 512, 1024] and batch size 32 in every
bucket, repeated without end. Compared, side by side and alternating:

- coordinated: ``Loader(job_name=..., num_consumers=4, consumer_index=i)``: every step's 4
  batches are one round, so they come from one bucket;
- independent: the same pipeline and job, ``Loader(job_name=...)`` without coordination:
  each consumer reads whatever batch comes next.

Reported: steps/s (median of the repeats), the mean padded tokens of a step's longest
batch, and the share of steps whose batches all come from one bucket; also the ratio a
plain simulation of the same length distribution predicts. Target ([5/7]): coordinated /
independent >= 1.8x.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from bench._common import free_port, join_or_kill, stop, version

BIN = pathlib.Path(sys.executable).parent
BOUNDARIES = [64, 128, 256, 512, 1024]
BATCH = 32
MU, SIGMA, LOW, HIGH = 5.0, 0.9, 8, 2048
US_PER_TOKEN = 1e-6
WARMUP_STEPS = 10
TARGET = 1.8


def lengths(count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(MU, SIGMA, count), LOW, HIGH).astype(np.int32)


def pipeline(count: int = 200_000) -> Any:
    from zloader import Pipeline

    table = lengths(count)

    def sequence(i: int) -> np.ndarray:
        return np.ones(table[i], np.int32)

    return (Pipeline.range(count, split_size=2048, shuffle_splits=True, seed=1)
            .map(sequence)
            .bucket_by_length(len, BOUNDARIES, [BATCH] * (len(BOUNDARIES) + 1))
            .repeat())


def bucket(batch: np.ndarray) -> int:
    return int(np.searchsorted(BOUNDARIES, batch.shape[1], side="right"))


def consumer(address: str, job: str, index: int, size: int, coordinated: bool, steps: int,
             barrier: Any, results: Any) -> None:
    from zloader import Loader

    kwargs = {"num_consumers": size, "consumer_index": index} if coordinated else {}
    with Loader(pipeline(), broker=address, job_name=job, timeout=120, **kwargs) as loader:
        batches = iter(loader)
        tokens, buckets = [], []
        started = 0.0
        for step in range(WARMUP_STEPS + steps):
            if step == WARMUP_STEPS:
                started = time.perf_counter()
            batch = next(batches)
            time.sleep(batch.shape[0] * batch.shape[1] * US_PER_TOKEN)
            barrier.wait(timeout=120)
            if step >= WARMUP_STEPS:
                tokens.append(int(batch.shape[0] * batch.shape[1]))
                buckets.append(bucket(batch))
        elapsed = time.perf_counter() - started
        barrier.wait(timeout=120)  # nobody leaves the job while another still reads
    results.put({"index": index, "elapsed": elapsed, "tokens": tokens, "buckets": buckets})


def run(address: str, mode: str, run_id: int, size: int, steps: int) -> dict[str, Any]:
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(size)
    results = context.Queue()
    job = f"{mode}-{run_id}"
    procs = [context.Process(target=consumer, args=(address, job, i, size,
                                                    mode == "coordinated", steps, barrier,
                                                    results)) for i in range(size)]
    for p in procs:
        p.start()
    try:
        out = sorted((results.get(timeout=300) for _ in procs), key=lambda r: r["index"])
    finally:
        join_or_kill(procs, 30)
    per_step = list(zip(*(r["tokens"] for r in out), strict=True))
    same = sum(len(set(b)) == 1 for b in zip(*(r["buckets"] for r in out), strict=True))
    elapsed = max(r["elapsed"] for r in out)
    return {"mode": mode, "steps_per_s": steps / elapsed,
            "longest_tokens": statistics.mean(max(s) for s in per_step),
            "mean_tokens": statistics.mean(t for s in per_step for t in s),
            "one_bucket": same / len(per_step)}


def simulate(size: int, steps: int = 20_000) -> float:
    """The ratio coordinated / independent that step times alone predict: each bucket
    emits batches in proportion to its share of sequences; an independent step takes its
    size batches from any buckets, a coordinated one from one bucket."""
    sample = lengths(400_000, seed=7)
    edges = np.searchsorted(BOUNDARIES, sample, side="right")
    rng = np.random.default_rng(3)
    batches = []
    for b in range(len(BOUNDARIES) + 1):
        members = sample[edges == b]
        rng.shuffle(members)
        usable = len(members) // BATCH * BATCH
        batches += [BATCH * int(m.max()) for m in members[:usable].reshape(-1, BATCH)]
    by_bucket: dict[int, list[int]] = {}
    for cost in batches:
        by_bucket.setdefault(int(np.searchsorted(BOUNDARIES, cost // BATCH, side="right")),
                             []).append(cost)
    order = rng.permutation(len(batches))
    independent = [max(batches[j] for j in order[i:i + size])
                   for i in range(0, min(len(order), steps * size) - size + 1, size)]
    rounds = []
    for costs in by_bucket.values():
        rounds += [max(costs[i:i + size]) for i in range(0, len(costs) - size + 1, size)]
    return float(np.mean(independent) / np.mean(rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2, help="preprocessing processes")
    parser.add_argument("--steps", type=int, default=200, help="measured steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    address = f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([str(BIN / "zloader-broker"), "--bind", address,
                               "--log-level", "warning"])
    worker = subprocess.Popen([str(BIN / "zloader-worker"), "--broker", address,
                               "--processes", str(args.workers), "--log-level", "warning"])
    rows: dict[str, list[dict[str, Any]]] = {"coordinated": [], "independent": []}
    try:
        for repeat in range(args.repeats):
            for mode in rows:
                result = run(address, mode, repeat, args.consumers, args.steps)
                rows[mode].append(result)
                print(f"[{repeat}] {mode}: {result['steps_per_s']:.1f} steps/s, longest batch "
                      f"{result['longest_tokens']:.0f} tokens, one bucket "
                      f"{100 * result['one_bucket']:.0f}% of steps", file=sys.stderr,
                      flush=True)
    finally:
        stop([worker, broker], 15)
    medians = {mode: {key: statistics.median(r[key] for r in results)
                      for key in ("steps_per_s", "longest_tokens", "mean_tokens",
                                  "one_bucket")}
               for mode, results in rows.items()}
    ratio = medians["coordinated"]["steps_per_s"] / medians["independent"]["steps_per_s"]
    simulated = simulate(args.consumers)
    head = (f"Coordinated reads: {args.consumers} consumer processes, {args.workers} worker "
            f"processes, {args.steps} measured steps per run (after {WARMUP_STEPS}), median "
            f"of {args.repeats} alternating runs, nproc {os.cpu_count()}, numpy "
            f"{version('numpy')}. Lengths log-normal(mu {MU}, sigma {SIGMA}) clipped to "
            f"[{LOW}, {HIGH}], bucket_by_length boundaries {BOUNDARIES}, batch {BATCH}; each "
            "consumer sleeps 1 us per padded token, then a barrier.")
    lines = ["| mode | steps/s | longest batch of a step (tokens) | mean batch (tokens) | "
             "steps with one bucket |", "|---|---|---|---|---|"]
    for mode, m in medians.items():
        lines.append(f"| {mode} | {m['steps_per_s']:.1f} | {m['longest_tokens']:.0f} | "
                     f"{m['mean_tokens']:.0f} | {100 * m['one_bucket']:.0f}% |")
    verdict = "holds" if ratio >= TARGET else "missed"
    notes = [f"- coordinated / independent: **{ratio:.2f}x** (target >= {TARGET}x: "
             f"{verdict}); a simulation of step times alone predicts {simulated:.2f}x.",
             "- Every run: " + "; ".join(
                 f"{mode} {', '.join(format(r['steps_per_s'], '.1f') for r in results)} "
                 "steps/s" for mode, results in rows.items())]
    text = "\n\n".join([head, "\n".join(lines), "\n".join(notes)])
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coordinated.md").write_text(text + "\n")
    (out / "coordinated.json").write_text(json.dumps(
        {"runs": rows, "medians": medians, "ratio": ratio, "simulated": simulated},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
