"""Exactly-once through stages that change the number of elements: seeded random pipelines
with a ``batch(k).map(f).unbatch()`` whose ``f`` gives 0-2 rows per element (with
shuffles, batches, a second such stage and a mix of two inputs around it), each run
through an embedded Loader with 2 workers twice: resumed from a state taken at a random
point, and with a worker SIGKILLed at a random point. Counts the rows lost and repeated
against ``pipeline.iter()``.

    python -m bench.exactness [--cases 24] [--out bench/results]

Run it on another checkout (``PYTHONPATH=that/checkout``) for the figures before a change.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import random
import time
from typing import Any

import numpy as np

from zloader import Loader, Pipeline


def spread(batch: Any) -> list[int]:
    """0, 1 or 2 distinct rows per element (rows that do not depend on the batch)."""
    return [int(x) * 10 + c for x in np.asarray(batch).reshape(-1) for c in range(int(x) % 3)]


def spread_again(batch: Any) -> list[int]:
    return [int(x) * 10 + c for x in np.asarray(batch).reshape(-1) for c in range(1 + int(x) % 2)]


def offset(k: int) -> Any:
    return lambda x: int(x) + k


def one_input(rng: random.Random, base: int) -> Pipeline:
    pipeline = Pipeline.range(rng.randrange(300, 900), split_size=rng.choice([20, 50]),
                              shuffle_splits=rng.random() < 0.5, seed=rng.randrange(99))
    pipeline = pipeline.map(offset(base))
    if rng.random() < 0.5:
        pipeline = pipeline.shuffle(rng.choice([10, 100]), seed=rng.randrange(99))
    pipeline = pipeline.batch(rng.randrange(2, 9)).map(spread).unbatch().map(int)
    if rng.random() < 0.3:
        pipeline = pipeline.batch(rng.randrange(2, 6)).map(spread_again).unbatch().map(int)
    if rng.random() < 0.5:
        pipeline = pipeline.shuffle(rng.choice([10, 100]), seed=rng.randrange(99))
    return pipeline


def generate(seed: int) -> Pipeline:
    rng = random.Random(seed)
    if rng.random() < 0.3:
        pipeline = Pipeline.mix([one_input(rng, 0), one_input(rng, 100_000)], [0.6, 0.4],
                                seed=rng.randrange(99))
    else:
        pipeline = one_input(rng, 0)
    return pipeline.batch(rng.randrange(2, 9)) if rng.random() < 0.5 else pipeline


def rows(elements: Any) -> collections.Counter:
    return collections.Counter(int(x) for e in elements for x in np.asarray(e).reshape(-1))


def case(seed: int, mode: str) -> tuple[int, int]:
    """(rows lost, rows repeated) of one generated pipeline run in ``mode``."""
    pipeline = generate(seed)
    want = rows(pipeline.iter(0))
    cut = random.Random(seed).randrange(1, max(2, sum(1 for _ in pipeline.iter(0))))
    out: list[Any] = []
    try:
        with Loader(pipeline, num_workers=2, timeout=30) as loader:
            elements = iter(loader)
            out += itertools.islice(elements, cut)
            if mode == "kill":
                loader._processes[0].kill()
                out += list(elements)
                state = None
            else:
                state = loader.state_dict()
        if state is not None:
            with Loader(pipeline, num_workers=2, timeout=30, state=state) as loader:
                out += list(loader)
    except Exception as exc:  # (a run that failed: everything after its cut is lost)
        print(f"  seed {seed} {mode}: {type(exc).__name__}: {str(exc)[:100]}")
    got = rows(out)
    return sum((want - got).values()), sum((got - want).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=24)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    table = []
    started = time.monotonic()
    for mode in ("resume", "kill"):
        exact = lost = repeated = worst_lost = worst_repeated = 0
        for seed in range(args.cases):
            one_lost, one_repeated = case(seed, mode)
            exact += not one_lost and not one_repeated
            lost, repeated = lost + one_lost, repeated + one_repeated
            worst_lost, worst_repeated = max(worst_lost, one_lost), max(worst_repeated,
                                                                        one_repeated)
        table.append({"mode": mode, "cases": args.cases, "exact": exact, "rows_lost": lost,
                      "rows_repeated": repeated, "worst_lost": worst_lost,
                      "worst_repeated": worst_repeated})
    lines = ["| fault | cases | exact | rows lost | rows repeated | worst case lost / repeated |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['cases']} | {r['exact']} | {r['rows_lost']} | "
              f"{r['rows_repeated']} | {r['worst_lost']} / {r['worst_repeated']} |"
              for r in table]
    print("\n".join(lines))
    print(f"({time.monotonic() - started:.0f} s)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "exactness.json"), "w") as out:
        json.dump(table, out, indent=1)
    with open(os.path.join(args.out, "exactness.md"), "w") as out:
        out.write("# Exactly-once through stages that change the number of elements\n\n"
                  "`python -m bench.exactness`: seeded random pipelines, 2 workers, a resume "
                  "or a worker SIGKILL at a random point, against `pipeline.iter()`.\n\n")
        out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
