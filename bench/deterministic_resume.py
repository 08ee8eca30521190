"""A deterministic Loader, reproducible and resumable together: is every run the same
stream, does a state taken at 10%, 50% and 90% of the epoch resume exactly the rest of it
with 1, 2 and 4 workers (from a state of 2), and what does the resume cost: the seconds
from the resumed Loader's construction to its first batch, against a fresh Loader's
(a resumed shard is made again from the epoch's start, so the cost grows with the
position). Two pipelines: 20,000 elements in 100 splits, a map that costs about 20 us an
element, a seeded shuffle and batches of 32; and a mix 0.6 / 0.3 / 0.1 of that (less
its shuffle) with inputs of 6,000 elements in 4 splits and 2,000 in 1, batched by 32 after
the mix (the consumer draws it over each input's shards).

    python -m bench.deterministic_resume [--out bench/results]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench._common import provenance, write_results
from zloader import Loader, Pipeline

POINTS = (0.1, 0.5, 0.9)
WORKERS = (1, 2, 4)


def work(value: int) -> int:
    until = time.perf_counter() + 20e-6
    while time.perf_counter() < until:
        pass
    return value * 3


def pipeline(kind: str) -> Pipeline:
    first = Pipeline.range(20_000, split_size=200, shuffle_splits=True, seed=1).map(work)
    if kind == "one input":
        return first.shuffle(256, seed=2).batch(32)
    others = [Pipeline.range(100_000, 106_000, split_size=1500),
              Pipeline.range(200_000, 202_000, split_size=2000)]
    return Pipeline.mix([first, *others], [0.6, 0.3, 0.1], seed=3).batch(32)


KINDS = ("one input", "a mix of 3 inputs")


def run(kind: str, workers: int, state: Any = None, stop: int | None = None
        ) -> tuple[list[list[int]], dict[str, Any], float]:
    started = time.perf_counter()
    first = None
    out: list[list[int]] = []
    with Loader(pipeline(kind), num_workers=workers, deterministic=True,
                state=state) as loader:
        for batch in loader:
            if first is None:
                first = time.perf_counter() - started
            out.append(np.asarray(batch).tolist())
            if stop is not None and len(out) == stop:
                break
        return out, loader.state_dict(), first or 0.0


def measure() -> dict[str, Any]:
    rows, batches, same = [], {}, True
    for kind in KINDS:
        whole, _, fresh = run(kind, 2)
        same = same and all(run(kind, 2)[0] == whole for _ in range(2))
        batches[kind] = len(whole)
        for point in POINTS:
            cut = int(len(whole) * point)
            head, state, _ = run(kind, 2, stop=cut)
            for workers in WORKERS:
                rest, _, first = run(kind, workers, state=state)
                rows.append({"pipeline": kind, "point": point, "workers": workers,
                             "exact": head + rest == whole, "first_batch_s": first,
                             "fresh_first_batch_s": fresh})
    return {"batches": batches, "same_every_run": same, "resumes": rows}


def tables(data: dict[str, Any]) -> list[str]:
    batches = data["batches"]
    if not isinstance(batches, dict):  # (a run before the mix was measured)
        batches = {"one input": batches}
    lines = [f"{', '.join(f'{kind}: {n} batches' for kind, n in batches.items())} an "
             "epoch; three runs the same stream, each: "
             f"{'yes' if data['same_every_run'] else 'NO'}. nproc {data['nproc']}, zloader at "
             f"{str(data['provenance']['commit'])[:12]}.", "",
             "| pipeline | state taken at | resumed with workers (state of 2) | the rest "
             "exactly | first batch after resume (s) | a fresh Loader's (s) | ratio |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {row.get('pipeline', 'one input')} | {row['point']:.0%} | {row['workers']} "
              f"| {'yes' if row['exact'] else 'NO'} | "
              f"{row['first_batch_s']:.3f} | {row['fresh_first_batch_s']:.3f} | "
              f"{row['first_batch_s'] / row['fresh_first_batch_s']:.1f}x |"
              for row in data["resumes"]]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.deterministic_resume",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    data = {"provenance": provenance(), "nproc": os.cpu_count(), **measure()}
    write_results(args.out, "deterministic_resume", data, tables(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
