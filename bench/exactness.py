"""Exactly-once through stages that change the number of elements: seeded random pipelines
with a ``batch(k).map(f).unbatch()`` whose ``f`` gives 0-2 rows per element (with
shuffles, batches, a second such stage and a mix of two inputs around it), each run
through an embedded Loader with 2 workers twice: resumed from a state taken at a random
point, and with a worker SIGKILLed at a random point. Counts the rows lost and repeated
against ``pipeline.iter()``.

    python -m bench.exactness [--cases 24] [--out bench/results]
    python -m bench.exactness --cost [--rounds 5] [--size 300000]

``--cost`` measures what exactly-once costs such a pipeline instead (a tokenizer's shape:
a shuffle, then ``batch(64).map(f).unbatch()`` with ``f`` dropping and repeating rows, a
filter and a batch): the epoch's time and the trainer's CPU with ``exactly_once`` on and
off and ``pipeline.iter()`` in one process, interleaved; ``state_dict()`` a third of the
way in, and a Loader resumed from it to its first batch against a fresh one's.

Run it on another checkout (``PYTHONPATH=that/checkout``) for the figures before a change.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import random
import resource
import statistics
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


def tokenized(batch: Any) -> np.ndarray:
    """A tokenizer's count: elements ``% 7 == 3`` dropped, those ``% 11 == 0`` twice."""
    keep = [int(x) for x in np.asarray(batch) if x % 7 != 3]
    return np.array(keep + [x for x in keep if x % 11 == 0], np.int64)


def odd_five(x: Any) -> bool:
    return int(x) % 5 != 1


def tokenizer_shaped(size: int) -> Pipeline:
    return (Pipeline.range(size, seed=1).shuffle(1000, seed=2).batch(64).map(tokenized)
            .unbatch().filter(odd_five).batch(32))


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _epoch(pipeline: Pipeline, exactly_once: bool) -> tuple[float, float, int]:
    """Wall and trainer CPU seconds of one epoch through a 2-worker Loader, and its rows."""
    wall, cpu = time.perf_counter(), _cpu()
    with Loader(pipeline, num_workers=2, exactly_once=exactly_once, timeout=120) as loader:
        count = sum(len(batch) for batch in loader)
    return time.perf_counter() - wall, _cpu() - cpu, count


def _resumed(pipeline: Pipeline, size: int) -> tuple[float, float, float]:
    """``state_dict()`` seconds a third of the way in; seconds to the first batch of a
    Loader resumed from it, and of a fresh one (each from its construction)."""
    with Loader(pipeline, num_workers=2, exactly_once=True, timeout=120) as loader:
        batches = iter(loader)
        for _ in range(size // 32 // 3):
            next(batches)
        started = time.perf_counter()
        state = loader.state_dict()
        took = time.perf_counter() - started
    firsts = []
    for resume in (state, None):
        started = time.perf_counter()
        with Loader(pipeline, num_workers=2, exactly_once=True, state=resume,
                    timeout=120) as loader:
            next(iter(loader))
            firsts.append(time.perf_counter() - started)
    return took, firsts[0], firsts[1]


def cost(rounds: int, size: int, out_dir: str) -> None:
    """The ``--cost`` table (module docstring)."""
    pipeline = tokenizer_shaped(size)
    runs: dict[str, list[tuple[float, float]]] = {"off": [], "on": [], "iter": []}
    resumes = []
    for _ in range(rounds):
        for name in ("off", "on"):
            wall, cpu, count = _epoch(pipeline, name == "on")
            runs[name].append((wall, cpu))
        started, cpu = time.perf_counter(), _cpu()
        expected = sum(len(batch) for batch in pipeline.iter(0))
        runs["iter"].append((time.perf_counter() - started, _cpu() - cpu))
        assert count == expected, (count, expected)
        resumes.append(_resumed(pipeline, size))
    wall = {name: statistics.median(w for w, _ in values) for name, values in runs.items()}
    cpu = {name: statistics.median(c for _, c in values) for name, values in runs.items()}
    state, resumed, fresh = (statistics.median(r[k] for r in resumes) for k in range(3))
    lines = [f"{size:,} elements ({expected:,} rows), 2 workers, medians of {rounds} "
             "interleaved rounds", "",
             "| run | epoch (s) | trainer CPU (s) | epoch / exactly_once=False |",
             "|---|---|---|---|"]
    lines += [f"| {label} | {wall[name]:.2f} | {cpu[name]:.2f} | "
              f"{wall[name] / wall['off']:.2f}x |"
              for name, label in [("off", "exactly_once=False"), ("on", "exactly_once=True"),
                                  ("iter", "pipeline.iter() (one process)")]]
    lines += ["", "| a third of the way in | seconds |", "|---|---|",
              f"| state_dict() | {state:.3f} |",
              f"| resumed Loader to its first batch | {resumed:.3f} |",
              f"| fresh Loader to its first batch | {fresh:.3f} |",
              f"| resumed / fresh | {resumed / fresh:.2f}x |"]
    print("\n".join(lines))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "exactness_cost.json"), "w") as out:
        json.dump({"size": size, "rows": expected, "rounds": rounds, "wall": wall, "cpu": cpu,
                   "state_dict": state, "resumed_first": resumed, "fresh_first": fresh},
                  out, indent=1)
    with open(os.path.join(out_dir, "exactness_cost.md"), "w") as out:
        out.write("# What exactly-once costs a tokenizer-shaped pipeline\n\n"
                  "`python -m bench.exactness --cost`: `range -> shuffle(1000) -> batch(64) "
                  "-> map (drops and repeats rows) -> unbatch -> filter -> batch(32)`.\n\n")
        out.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=24)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--cost", action="store_true",
                        help="measure what exactly-once costs instead (module docstring)")
    parser.add_argument("--rounds", type=int, default=5, help="--cost: interleaved rounds")
    parser.add_argument("--size", type=int, default=300_000, help="--cost: source elements")
    args = parser.parse_args()
    if args.cost:
        cost(args.rounds, args.size, args.out)
        return
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
