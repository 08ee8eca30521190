"""Several jobs on one broker's worker pool, with real broker and worker processes: a
validation Loader beside a training one (as Keras ``fit(validation_data=...)`` runs them),
an endless job beside a finite one, and four jobs sharing eight workers (docs/pool.md)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import pytest

from tests.service import service, status, wait_for
from zloader import Loader, Pipeline


def slow(x: int) -> int:
    time.sleep(0.002)
    return x


def drain(iterator, count: int | None = None) -> collections.Counter:
    seen: collections.Counter = collections.Counter()
    for i, x in enumerate(iterator):
        seen[x] += 1
        if count is not None and i + 1 == count:
            break
    return seen


def once(seen: collections.Counter, n: int) -> None:
    assert sorted(seen) == list(range(n)), f"missing {sorted(set(range(n)) - set(seen))[:10]}"
    repeated = {x: c for x, c in seen.items() if c > 1}
    assert not repeated, f"repeated: {list(repeated.items())[:10]}"


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow),
                                     pytest.param(4, marks=pytest.mark.slow)])
def test_train_and_validation_loaders_on_one_broker_each_read_every_epoch(workers):
    """Keras's order: a training epoch, then the validation epoch, twice; the first time
    the training iterator is paused halfway (``steps_per_epoch``) while validation runs.
    The validation job gets workers the training job held, and both read every element of
    every epoch once: the moved workers lose and repeat nothing."""
    with service(workers=workers) as (address, _), \
            Loader(Pipeline.range(600, split_size=20).map(slow), broker=address,
                   timeout=30) as train, \
            Loader(Pipeline.range(200, split_size=10).map(slow), broker=address,
                   timeout=30) as validation:
        elements = iter(train)
        seen = drain(elements, 300)
        once(drain(validation), 200)
        seen += drain(elements)
        once(seen, 600)
        once(drain(train), 600)
        once(drain(validation), 200)


def test_a_job_without_exactly_once_drains_the_worker_it_gives_and_repeats_nothing():
    """``exactly_once=False``: two workers read a shuffled, batched job when a second job
    registers mid-epoch and takes one of them, while the first job's loop is paused (as
    Keras pauses training for validation). The worker finishes its split (its shuffle
    buffer and batch included) and sends it beyond the one credit it holds before it
    moves: the first job gets every element once, the second all of its own. (A worker
    that waited for credits would move only after MOVE_DRAIN_SECONDS, its split read
    again: repeats.)"""
    pipeline = Pipeline.range(400, split_size=25).map(slow).shuffle(16).batch(4)
    with service(workers=2) as (address, _), \
            Loader(pipeline, broker=address, timeout=30, exactly_once=False,
                   prefetch=1) as first, \
            Loader(Pipeline.range(100, split_size=10).map(slow), broker=address,
                   timeout=30) as second:
        elements = iter(first)
        seen: collections.Counter = collections.Counter()
        for _ in range(20):
            seen.update(int(x) for x in next(elements))
        wait_for(lambda: len(status(address)["workers"]) == 2, what="two workers")
        once(drain(second), 100)  # it gets a worker of the first job's
        for batch in elements:
            seen.update(int(x) for x in batch)
        once(seen, 400)


def test_a_job_without_exactly_once_loses_nothing_when_its_only_worker_moves():
    """One worker, ``exactly_once=False``, training paused halfway while validation runs
    (Keras): the worker moves to validation and back. Had it drained, its END would have
    ended the training epoch with splits nobody took (240 of 600 elements lost); the last
    worker moves at once instead, and what it had read is read again (at least once)."""
    pipeline = Pipeline.range(600, split_size=20).map(slow).shuffle(32)
    with service(workers=1) as (address, _), \
            Loader(pipeline, broker=address, timeout=30, exactly_once=False) as train, \
            Loader(Pipeline.range(200, split_size=10).map(slow), broker=address,
                   timeout=30) as validation:
        elements = iter(train)
        seen = drain(elements, 300)
        once(drain(validation), 200)
        seen += drain(elements)
        assert sorted(seen) == list(range(600)), \
            f"missing {sorted(set(range(600)) - set(seen))[:10]}"


@pytest.mark.slow
def test_torch_train_and_validation_dataloaders_on_one_broker_alternate_epochs():
    """The torch drop-in's jobs are deterministic (torch's exact batches), so their workers
    move only between epochs: a training and a validation DataLoader on one broker with
    two workers, persistent workers, three epochs each, every sample each epoch."""
    import torch

    import zloader.torch

    class Numbers(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> int:
            return i

    with service(workers=2) as (address, _):
        train = zloader.torch.DataLoader(Numbers(256), batch_size=16, shuffle=True,
                                         num_workers=2, broker=address,
                                         persistent_workers=True, timeout=30)
        validation = zloader.torch.DataLoader(Numbers(64), batch_size=16, num_workers=2,
                                              broker=address, persistent_workers=True,
                                              timeout=30)
        try:
            for _ in range(3):
                assert sorted(int(x) for b in train for x in b) == list(range(256))
                assert [int(x) for b in validation for x in b] == list(range(64))
        finally:
            del train, validation


@pytest.mark.slow  # (7 s; the plain-call pool tests and test_service's status test stay fast)
def test_a_job_beside_an_endless_one_gets_its_first_element_soon_and_a_fair_share():
    """Two worker processes; the first job repeats forever. The second, started later,
    gets its first element within 5 s and at least 30% of the pool's output while both
    read."""
    with service(workers=2) as (address, _), \
            Loader(Pipeline.range(1000, split_size=10).map(slow).repeat(), broker=address,
                   timeout=30) as endless, \
            Loader(Pipeline.range(100_000, split_size=10).map(slow), broker=address,
                   timeout=30) as late:
        counts = {"endless": 0, "late": 0}
        stop = threading.Event()

        def read() -> None:
            for _ in endless:
                counts["endless"] += 1
                if stop.is_set():
                    return

        reader = threading.Thread(target=read)
        reader.start()
        try:
            wait_for(lambda: counts["endless"] > 200, what="the endless job")
            start = time.monotonic()
            elements = iter(late)
            next(elements)
            assert time.monotonic() - start < 5.0, "the late job waited for a worker"
            time.sleep(1.0)  # let the pool settle, then measure both
            before = dict(counts)
            for _ in elements:
                counts["late"] += 1
                if counts["late"] >= 1000:
                    break
            got = {k: counts[k] - before[k] for k in counts}
        finally:
            stop.set()
            reader.join(30)
        assert got["late"] / (got["late"] + got["endless"]) >= 0.3, got


@pytest.mark.slow
def test_four_jobs_on_eight_workers_each_get_an_equal_share():
    """Four jobs read at once from eight workers: each runs on two and its output is
    within 20% of the mean."""
    with service(workers=8) as (address, _):
        loaders = [Loader(Pipeline.range(10**6, split_size=20).map(_sleepy(i)),
                          broker=address, timeout=60) for i in range(4)]
        counts = [0] * 4
        stop = threading.Event()
        measuring = threading.Event()

        def read(index: int) -> None:
            for _ in loaders[index]:
                if measuring.is_set():
                    counts[index] += 1
                if stop.is_set():
                    return

        readers = [threading.Thread(target=read, args=(i,)) for i in range(4)]
        try:
            for reader in readers:
                reader.start()
                time.sleep(0.5)  # they arrive one after the other

            def spread() -> list[int]:
                jobs = status(address)["jobs"]
                return sorted(j["workers"] for j in jobs)

            wait_for(lambda: spread() == [2, 2, 2, 2], what="two workers per job")
            measuring.set()
            time.sleep(4.0)
            measuring.clear()
        finally:
            stop.set()
            for reader in readers:
                reader.join(30)
            for loader in loaders:
                loader.close()
        mean = sum(counts) / 4
        assert all(abs(c - mean) <= 0.2 * mean for c in counts), counts


def _sleepy(salt: int):
    """A distinct pipeline per job (so none is shared): 5 ms an element."""
    def work(x: int) -> int:
        time.sleep(0.005)
        return x + salt
    return work


class Counted:
    """A map function that notes in the file ``path`` each time it is unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, value: int) -> int:
        return value

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickled, (self.path,))


def _unpickled(path: str) -> Counted:
    with open(path, "a") as file:
        file.write("unpickled\n")
    return Counted(path)


def test_a_worker_keeps_a_pipeline_warm_for_its_next_job_and_says_so(tmp_path):
    """The second job of a pipeline the worker ran reuses what it loaded (not unpickled
    again); another pipeline is loaded; ``zloader status`` lists what is warm."""
    notes = tmp_path / "notes"
    first = Pipeline.range(20).map(Counted(str(notes)), version="v1")
    other = Pipeline.range(20).map(Counted(str(notes)), version="v2")
    with service(workers=1) as (address, _):
        for pipeline in (first, first, other, first):
            with Loader(pipeline, broker=address, timeout=30) as loader:
                assert sorted(loader) == list(range(20))
        assert notes.read_text().count("unpickled") == 2
        wait_for(lambda: set(status(address)["workers"][0]["warm"])
                 == {first.fingerprint, other.fingerprint}, what="the warm list")
