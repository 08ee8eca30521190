"""The resume matrix ([4/5] item 2): every cell exact, 0 elements lost and 0 repeated over
the whole epoch, checked against what the pipeline yields in one process.

{resume once, resume twice in a row} x {no fault, a worker SIGKILLed before the state was
taken} x {the same consumer, job_name consumers 4 -> 3 and 3 -> 4 (the world size changing
between runs: every new consumer is handed every saved state)} x {no mix, a mix whose
weights were changed before the state was taken, a map that changes the number of
elements between a shuffle and an unbatch}. A few cells run by default; the rest
are marked slow.
"""

from __future__ import annotations

import collections
import itertools
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.service import service, start_worker
from zloader import Loader, Pipeline

N = 1200
TAKE = 250  # elements taken in each run before its states are saved


def plain() -> Pipeline:
    return Pipeline.range(N, split_size=40).shuffle(200, seed=3).map(lambda x: ("r", int(x)))


def tagged(name: str):
    return lambda x: (name, int(x))


def mixed() -> Pipeline:
    return Pipeline.mix([Pipeline.range(800, split_size=40).map(tagged("a")),
                         Pipeline.range(400, split_size=40).map(tagged("b"))],
                        [0.5, 0.5], seed=5)


def spread(batch: Any) -> list[int]:
    """Each element of the batch becomes 0, 1 or 2 distinct rows: a map that changes the
    number of elements (its rows made again from the batch when some are lost)."""
    return [int(x) * 10 + c for x in batch for c in range(int(x) % 3)]


def changing() -> Pipeline:
    return (Pipeline.range(N, split_size=40).shuffle(200, seed=3).batch(5).map(spread)
            .unbatch().map(lambda v: ("c", int(v))))


def expected(pipeline: Pipeline) -> collections.Counter:
    return collections.Counter((str(n), int(x)) for n, x in pipeline.iter(0))


def take(live: list[Iterator[Any]], count: int | None, seen: collections.Counter,
         firsts: list[float], started: float) -> None:
    """Take ``count`` elements (all when None) from the iterators ``live`` in turn (those
    that end leave it), noting how long the first took since ``started``."""
    taken = 0
    while live and (count is None or taken < count):
        for iterator in list(live):
            try:
                name, x = next(iterator)
            except StopIteration:
                live.remove(iterator)
                continue
            if taken == 0:
                firsts.append(time.monotonic() - started)
            seen[(str(name), int(x))] += 1
            taken += 1
            if count is not None and taken >= count:
                break


def run(address: str, pipeline: Pipeline, consumers: int, states: list | None,
        count: int | None, seen: collections.Counter, firsts: list[float],
        weights: list[float] | None, kill: Any = None) -> list[dict[str, Any]]:
    """One run of ``consumers`` Loaders (one without a job_name), resumed from ``states``:
    take ``count`` elements (``kill``, if given, is called halfway), then save and return
    their states."""
    name = {"job_name": "matrix"} if consumers > 1 else {}
    started = time.monotonic()
    loaders = [Loader(pipeline, broker=address, timeout=30, state=states, **name)
               for _ in range(consumers)]
    try:
        if weights is not None and states is None:
            for loader in loaders:
                loader.set_weights(weights)
        live = [iter(loader) for loader in loaders]  # (a second iter() is the next epoch)
        if kill is None:
            take(live, count, seen, firsts, started)
        else:
            half = None if count is None else count // 2
            take(live, half, seen, firsts, started)
            kill()
            take(live, None if count is None else count - half, seen, [], started)
        return [loader.state_dict() for loader in loaders] if count is not None else []
    finally:
        for loader in loaders:
            loader.close()


CELLS = [(resumes, fault, world, kind)
         for resumes, fault, world, kind in itertools.product(
             (1, 2), (False, True), ((1, 1), (4, 3), (3, 4)), ("plain", "mix", "changing"))]
FAST = {(1, False, (1, 1), "plain"), (2, True, (4, 3), "mix"), (1, True, (3, 4), "plain"),
        (2, True, (3, 4), "changing")}


@pytest.mark.parametrize("resumes, fault, world, kind", [
    cell if cell in FAST else pytest.param(*cell, marks=pytest.mark.slow) for cell in CELLS],
    ids=[f"resume{r}-{'kill' if f else 'nofault'}-{w[0]}to{w[1]}-{k}"
         for r, f, w, k in CELLS])
def test_every_cell_of_the_resume_matrix_is_exact(resumes, fault, world, kind):
    mix = kind == "mix"
    pipeline = {"plain": plain, "mix": mixed, "changing": changing}[kind]()
    weights = [0.3, 0.7] if mix else None
    seen: collections.Counter = collections.Counter()
    firsts: list[float] = []
    with service(workers=2) as (address, procs):
        def kill() -> None:
            victim = next(p for p in procs if p.poll() is None)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            procs.append(start_worker(address))

        before, after = world
        states = run(address, pipeline, before, None, TAKE, seen, firsts, weights,
                     kill if fault else None)
        for _ in range(resumes - 1):  # a resume of a resume
            states = run(address, pipeline, after, states, TAKE, seen, firsts, weights)
            assert all(state.get("weights") == weights for state in states) or not mix
        run(address, pipeline, after, states, None, seen, firsts, weights)
    want = expected(pipeline)
    repeated = {k: v for k, v in seen.items() if v > 1}
    lost = set(want) - set(seen)
    assert not repeated and not lost, (f"repeated {len(repeated)}: {list(repeated)[:5]}, "
                                       f"lost {len(lost)}: {sorted(lost)[:5]}")
    assert seen == want
    assert max(firsts) < 15, firsts  # does not hang (the figure is bench material)
