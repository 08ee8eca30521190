"""A mix's weights in every window of the stream a trainer sees, with 1, 2, 4 and 8
workers: zloader (the consumer draws, the default), zloader packing after the mix (a
``batch(8).map(f).unbatch()`` whose map makes groups: the consumer draws and makes them),
zloader with a ``repeat`` after the mix (moved onto the mix's inputs so that the consumer
still draws it; with ``stop="first_exhausted"`` the consumer draws it pass by pass),
zloader with the workers drawing (forced here by two ``repeat``s after a ``batch`` after the
mix, which the consumer does not draw through; as a shared, coordinated or static
deterministic job draws it), each input of fewer than 16 splits read in 16 so that every
worker holds some of it (``zloader.plan.spread``) and, as before that, with the inputs as
written, and torch's
``DataLoader`` over an ``IterableDataset`` that mixes in each worker the shards it takes
of each input (how Hugging Face ``interleave_datasets`` and most hand-written torch mixes
run with ``num_workers``).

Three inputs, weights 0.6 / 0.3 / 0.1, of 60,000 / 30,000 / 10,000 elements in 60 / 4 / 1
splits (a small corpus in one shard), mixed with seed 7 and batched by 32 after the mix.
Each element is ``input * 1,000,000 + i``, so the input of every place in the stream is
known. Over the first ``--elements`` (default 80,000: before the in-process mix runs out
of any input), windows of 1,000: how many fail Pearson's chi-square against the weights
at p < 0.001, the smallest p, and the range of the 10% input's share. Also the seconds
from the Loader's construction to its first batch and the elements per second over the
epoch (the trainer's process only reads), and, with ``stop="first_exhausted"``, the
elements an epoch yields against ``iter()``'s.

    python -m bench.mix_windows [--workers 1 2 4 8] [--out bench/results]

These machines are shared and noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from bench._common import provenance, write_results
from zloader import Loader, Pipeline

WEIGHTS = (0.6, 0.3, 0.1)
SIZES = (60_000, 30_000, 10_000)
SPLITS = (60, 4, 1)
BASE = 1_000_000
BATCH = 32
SEED = 7
WINDOW = 1000
P_FLOOR = 0.001


def chi_square_p(observed: Sequence[int], shares: Sequence[float]) -> float:
    """The p-value of Pearson's chi-square test of ``observed`` counts against
    ``shares`` (the regularized upper incomplete gamma function, by its series)."""
    total = sum(observed)
    stat = sum((o - total * s) ** 2 / (total * s) for o, s in zip(observed, shares,
                                                                     strict=True))
    a, x = (len(observed) - 1) / 2, stat / 2
    if x == 0:
        return 1.0
    term = summed = 1.0 / a
    n = 1
    while term > 1e-15 * summed:
        term *= x / (a + n)
        summed += term
        n += 1
    return max(0.0, 1.0 - summed * math.exp(-x + a * math.log(x) - math.lgamma(a)))


def inputs() -> list[Pipeline]:
    return [Pipeline.range(k * BASE, k * BASE + size, split_size=-(-size // splits))
            for k, (size, splits) in enumerate(zip(SIZES, SPLITS, strict=True))]


def pipelines(stop: str = "all_exhausted") -> dict[str, tuple[Pipeline, dict[str, Any]]]:
    """Each zloader system: its pipeline and the Loader's options."""
    mix = Pipeline.mix(inputs(), list(WEIGHTS), seed=SEED, stop=stop)
    return {"zloader (the consumer draws)": (mix.batch(BATCH), {}),
            "zloader, packing after the mix": (
                mix.batch(8).map(repacked).unbatch().batch(BATCH), {}),
            "zloader, deterministic=True (the consumer draws over shards)": (
                mix.batch(BATCH), {"deterministic": True}),
            "zloader, a repeat after the mix (moved, or pass by pass)": (
                mix.repeat(1).batch(BATCH), {}),
            "zloader, the workers draw (each input spread over them)": (
                mix.batch(BATCH).repeat(1).repeat(1), {}),
            NOT_SPREAD: (mix.batch(BATCH).repeat(1).repeat(1), {})}


NOT_SPREAD = "zloader, the workers draw, inputs as written (before)"
"""How a mix the workers draw ran before ``zloader.plan.spread``: that function is made
to leave the inputs as they are for this row alone (its workers are forked from this
process, so they plan the same way)."""


@contextlib.contextmanager
def as_written(name: str) -> Iterator[None]:
    """For the row ``name`` :data:`NOT_SPREAD`, a mix the workers draw reads its inputs
    as written (their few splits), as before ``spread``."""
    if name != NOT_SPREAD:
        yield
        return
    import zloader.plan

    spread = zloader.plan.spread
    zloader.plan.spread = lambda pipeline: pipeline
    try:
        yield
    finally:
        zloader.plan.spread = spread


def repacked(batch: Any) -> Any:
    """A packer's map that keeps the elements as they are (so that each place's input is
    still known), whose rows are a group's all the same (any map between a batch and its
    unbatch may change the number of rows)."""
    return np.asarray(batch).copy()


class TorchMix:
    """A torch IterableDataset that mixes, in each worker, the shards it takes of each
    input (shard ``s`` of an input goes to worker ``s % workers``), by weight among the
    inputs it still has, seeded per worker."""

    def __init__(self) -> None:
        self.shards = [[range(k * BASE + start, k * BASE + min(start + -(-size // splits),
                                                                size))
                        for start in range(0, size, -(-size // splits))]
                       for k, (size, splits) in enumerate(zip(SIZES, SPLITS, strict=True))]

    def __iter__(self) -> Iterator[int]:
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        streams = [iter([x for shard in shards[worker::workers] for x in shard])
                   for shards in self.shards]
        rng = np.random.default_rng(SEED * 100 + worker)
        live = [k for k in range(len(streams))]
        while live:
            shares = np.array([WEIGHTS[k] for k in live])
            k = live[int(rng.choice(len(live), p=shares / shares.sum()))]
            value = next(streams[k], None)
            if value is None:
                live.remove(k)
                continue
            yield value


def torch_batches(workers: int) -> Iterator[Any]:
    import torch.utils.data

    dataset = type("Mix", (TorchMix, torch.utils.data.IterableDataset), {})()
    return iter(torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=workers))


def run(make: Callable[[], Iterator[Any]], closing: Any = None) -> dict[str, Any]:
    """Iterate ``make()``'s batches: their elements' inputs, when the first came, the
    epoch's seconds."""
    started = time.perf_counter()
    first = None
    values: list[int] = []
    try:
        for batch in make():
            if first is None:
                first = time.perf_counter() - started
            values.extend(int(v) for v in np.asarray(batch).reshape(-1))
    finally:
        if closing is not None:
            closing()
    seconds = time.perf_counter() - started
    return {"values": values, "first_batch_s": first, "seconds": seconds}


def windows(values: list[int], limit: int) -> dict[str, Any]:
    """The windows of WINDOW over the first ``limit`` values: how many fail, the
    smallest p, the 10% input's share's range."""
    which = [v // BASE for v in values[:limit]]
    ps, small = [], []
    for start in range(0, len(which) - WINDOW + 1, WINDOW):
        window = which[start:start + WINDOW]
        counts = [window.count(k) for k in range(len(WEIGHTS))]
        ps.append(chi_square_p(counts, WEIGHTS))
        small.append(counts[2] / WINDOW)
    return {"windows": len(ps), "failing": sum(p < P_FLOOR for p in ps),
            "smallest_p": min(ps) if ps else None,
            "small_share": [min(small), max(small)] if small else None}


def measure(workers: list[int], limit: int) -> dict[str, Any]:
    reference = [int(v) for v in Pipeline.mix(inputs(), list(WEIGHTS), seed=SEED).iter(0)]
    results: list[dict[str, Any]] = []
    for count in workers:
        for name, (pipeline, options) in pipelines().items():
            with as_written(name):
                loader = Loader(pipeline, num_workers=count, timeout=120, **options)
                got = run(lambda loader=loader: iter(loader), loader.close)
            results.append(_record(name, count, got, limit, reference))
        got = run(lambda count=count: torch_batches(count))
        results.append(_record("torch DataLoader, a mix per worker", count, got, limit,
                               reference))
    first = []  # stop="first_exhausted": the elements of an epoch against iter()'s
    want = sum(1 for _ in Pipeline.mix(inputs(), list(WEIGHTS), seed=SEED,
                                       stop="first_exhausted").iter(0))
    for count in workers:
        for name, (pipeline, options) in pipelines("first_exhausted").items():
            with as_written(name), Loader(pipeline, num_workers=count, timeout=120,
                                          **options) as loader:
                got = sum(len(np.asarray(batch).reshape(-1)) for batch in loader)
            first.append({"system": name, "workers": count, "elements": got, "iter": want})
    return {"runs": results, "first_exhausted": first}


def _record(name: str, workers: int, got: dict[str, Any], limit: int,
            reference: list[int]) -> dict[str, Any]:
    values = got["values"]
    same = sorted(values) == sorted(reference)
    draws = [v // BASE for v in values] == [v // BASE for v in reference]
    return {"system": name, "workers": workers, "elements": len(values),
            "first_batch_s": got["first_batch_s"], "seconds": got["seconds"],
            "elements_per_s": len(values) / got["seconds"], "every_element_once": same,
            "iter_draws": draws, **windows(values, limit)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mix_windows", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--elements", type=int, default=80_000)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    results = {"provenance": provenance(), "nproc": os.cpu_count(),
               "window": WINDOW, "p_floor": P_FLOOR, "weights": WEIGHTS, "sizes": SIZES,
               "splits": SPLITS, "limit": args.elements,
               **measure(args.workers, args.elements)}
    from bench.report import mix_windows_tables
    write_results(args.out, "mix_windows", results, mix_windows_tables(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
