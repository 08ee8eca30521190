"""zloader.torch.DataLoader against torch.utils.data.DataLoader: same arguments, same
batches in the same order (torch.equal on every tensor)."""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys

import numpy as np
import psutil
import pytest
import torch
import torch.utils.data

import zloader.torch as zt
from zloader import PipelineError, Timeout, codec
from zloader.torch.source import stack_later


class Augmented(torch.utils.data.Dataset):
    """Samples drawn with all three RNGs a worker seeds: torch, numpy and random."""

    def __init__(self, n: int = 37) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        noise = torch.rand(2) + float(np.random.rand()) + random.random()
        return {"x": noise + i, "pair": (torch.tensor(i), i * 0.5), "name": f"s{i}"}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _seed_globals(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def both(**kwargs):
    """A torch DataLoader and a zloader one, each with its own generator seeded alike."""
    seed = kwargs.pop("seed", 0)
    dataset = kwargs.pop("dataset", None) or Augmented()
    made = []
    for cls in (torch.utils.data.DataLoader, zt.DataLoader):
        generator = torch.Generator().manual_seed(seed)
        made.append(cls(dataset, generator=generator, **kwargs))
    return made


CASES = [
    {"batch_size": 4},
    {"batch_size": 4, "shuffle": True},
    {"batch_size": 5, "shuffle": True, "drop_last": True},
    {"batch_size": 3, "sampler": list(reversed(range(37)))},
    {"batch_size": 4, "shuffle": True, "collate_fn": lambda samples: [s["x"] for s in samples]},
    {"batch_size": None, "shuffle": True},
    {"batch_sampler": [[1, 2, 3], [7], [30, 31]]},
]


@pytest.mark.parametrize("workers, kwargs", [
    *[(w, kwargs) for w in (0, 2) for kwargs in CASES],
    (2, {"batch_size": 4, "shuffle": True, "persistent_workers": True}),  # needs workers
])
def test_same_batches_in_the_same_order_as_torch(kwargs, workers):
    reference, ours = both(num_workers=workers, **kwargs)
    try:
        assert len(ours) == len(reference)
        for epoch in range(2):  # two epochs: fresh sampling and worker seeds each time
            # Without workers the dataset draws from this process's global RNGs: start
            # both loaders from the same state (torch would differ from itself otherwise).
            _seed_globals(epoch)
            expected = list(reference)
            _seed_globals(epoch)
            got = list(ours)
            assert len(got) == len(expected)
            assert all(same(a, b) for a, b in zip(expected, got, strict=True))
    finally:
        ours.close()


class Sharded(torch.utils.data.IterableDataset):
    """Shards itself by worker, as torch's documentation shows."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, 40, workers):
            yield {"i": i, "seed_ok": torch.tensor(info is not None and info.seed >= 0)}


def test_iterable_dataset_that_shards_itself_yields_each_sample_once_in_torch_order():
    reference, ours = both(dataset=Sharded(), num_workers=2, batch_size=3)
    try:
        expected, got = list(reference), list(ours)
        assert all(same(a, b) for a, b in zip(expected, got, strict=True))
        values = sorted(int(i) for batch in got for i in batch["i"])
        assert values == list(range(40))
    finally:
        ours.close()


def _init(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == worker_id
    np.random.seed(1000 + worker_id)  # an init_fn that reseeds, as users write them


def test_worker_init_fn_runs_in_each_worker_as_in_torch():
    reference, ours = both(num_workers=2, batch_size=4, shuffle=True, worker_init_fn=_init)
    try:
        for _ in range(2):
            assert all(same(a, b) for a, b in zip(list(reference), list(ours), strict=True))
    finally:
        ours.close()


_INITS: list[int] = []


def _count_init(worker_id: int) -> None:
    _INITS.append(worker_id)


class InitsSeen(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Each item: the worker that made it, its seed, and the worker_init_fn calls its
    process saw (all of them this worker's)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        info = torch.utils.data.get_worker_info()
        return torch.tensor([info.id, torch.initial_seed() - info.seed, len(_INITS),
                             sum(w != info.id for w in _INITS)])


def test_each_forked_worker_is_seeded_once_as_its_index_before_its_first_batch():
    """A forked worker seeds itself (worker_init_fn included) at its fork, for the index
    the broker then gives it (READY.slot): each batch says its worker ran the init once,
    as itself, and is seeded as torch seeds that worker; the same over a second epoch."""
    reference, ours = both(dataset=InitsSeen(), num_workers=3, batch_size=2,
                           worker_init_fn=_count_init)
    try:
        for _ in range(2):
            expected, got = list(reference), list(ours)
            assert all(same(a, b) for a, b in zip(expected, got, strict=True))
            rows = torch.cat(got)
            assert rows[:, 1].eq(0).all() and rows[:, 2].eq(1).all() and rows[:, 3].eq(0).all()
            assert sorted(set(rows[:, 0].tolist())) == [0, 1, 2]
    finally:
        ours.close()


class Broken(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        if i == 6:
            raise KeyError(f"no sample {i}")
        return i


def test_dataset_errors_arrive_with_the_index_and_original_type():
    loader = zt.DataLoader(Broken(), batch_size=2, num_workers=2)
    try:
        with pytest.raises(KeyError) as info:
            list(loader)
        assert isinstance(info.value, PipelineError)
        assert "index 6" in str(info.value) and "no sample 6" in info.value.traceback
    finally:
        loader.close()


def test_torch_argument_errors_are_torchs():
    with pytest.raises(ValueError, match="prefetch_factor"):
        zt.DataLoader(Augmented(), num_workers=0, prefetch_factor=2)
    with pytest.raises(ValueError, match="persistent_workers"):
        zt.DataLoader(Augmented(), num_workers=0, persistent_workers=True)


def test_pin_memory_without_an_accelerator_warns_like_torch():
    loader = zt.DataLoader(Augmented(), batch_size=8, num_workers=2, pin_memory=True)
    try:
        with pytest.warns(UserWarning, match="pin_memory"):
            batches = list(loader)
        assert len(batches) == 5
        if torch.cuda.is_available():  # pragma: no cover - GPU machines only
            assert batches[0]["x"].is_pinned()
    finally:
        loader.close()


def test_device_copies_run_ahead_on_a_background_thread_and_keep_batches_identical():
    reference, ours = both(num_workers=2, batch_size=4, shuffle=True)
    ours.device = torch.device("cpu")  # the same path as cuda, minus the side stream
    try:
        expected, got = list(reference), list(ours)
        assert all(same(a, b) for a, b in zip(expected, got, strict=True))
    finally:
        ours.close()


def test_errors_cross_the_prefetch_thread():
    loader = zt.DataLoader(Broken(), batch_size=2, num_workers=2, device="cpu")
    try:
        with pytest.raises(KeyError, match="no sample 6"):
            list(loader)
    finally:
        loader.close()


class Reused(torch.utils.data.Dataset):
    """Large samples written into one tensor that every call overwrites (legal with torch,
    whose collate copies at once): the batches must still be torch's."""

    def __init__(self, n: int = 24) -> None:
        self.n = n
        self.buffer = torch.zeros(3, 64, 64)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.buffer.fill_(float(i))
        self.buffer[0, 0, 0] = torch.rand(())
        return self.buffer, torch.full((128,), i, dtype=torch.int16)


def test_large_batches_copied_once_into_shared_memory_are_torchs():
    dataset = Reused()
    batch = [dataset[i] for i in range(4)]
    assert isinstance(stack_later([s[0].clone() for s in batch]), codec.Stacked)
    reference, ours = both(dataset=dataset, batch_size=4, shuffle=True, num_workers=2)
    try:
        for _ in range(2):
            expected, got = list(reference), list(ours)
            assert len(got) == len(expected) == 6
            assert all(same(a, b) for a, b in zip(expected, got, strict=True))
    finally:
        ours.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_load_state_dict_resumes_mid_epoch_with_the_batches_not_yet_yielded(workers):
    dataset = torch.utils.data.TensorDataset(torch.arange(50))

    def loader():
        return zt.DataLoader(dataset, batch_size=4, shuffle=True, num_workers=workers,
                             generator=torch.Generator().manual_seed(7))

    first = loader()
    try:
        whole = [b[0].tolist() for b in first]  # epoch 0, uninterrupted
    finally:
        first.close()
    interrupted = loader()
    try:
        before = []
        for batch in interrupted:
            before.append(batch[0].tolist())
            if len(before) == 5:
                state = interrupted.state_dict()
                break
    finally:
        interrupted.close()
    assert len(json.dumps(state)) < 64 * 1024
    resumed = loader()
    try:
        resumed.load_state_dict(json.loads(json.dumps(state)))
        after = [b[0].tolist() for b in resumed]
        assert before + after == whole  # the same epoch, each batch once
        assert resumed.state_dict()["batches"] == 0  # finished: the next epoch is due
    finally:
        resumed.close()
    with pytest.raises(ValueError, match="state_dict"):
        zt.DataLoader(dataset).load_state_dict({"batches": 3})


def test_iterable_dataset_state_dict_resumes_a_pipeline_epoch():
    from zloader import Pipeline

    pipeline = Pipeline.range(400, split_size=20).shuffle(50)
    dataset = zt.IterableDataset(pipeline, num_workers=2)
    seen = []
    try:
        for x in dataset:
            seen.append(int(x))
            if len(seen) == 150:
                state = dataset.state_dict()
                break
    finally:
        dataset.close()
    resumed = zt.IterableDataset(pipeline, num_workers=2)
    try:
        resumed.load_state_dict(state)
        seen += [int(x) for x in resumed]
    finally:
        resumed.close()
    assert sorted(seen) == list(range(400))


def _interleaved(loader):
    a, b = iter(loader), iter(loader)
    return [next(a), next(b), next(a), *b]


def _zipped(loader):
    return list(zip(loader, loader, strict=False))


def _peek_then_loop(loader):
    return [next(iter(loader)), *loader]


def _old_after_new(loader):
    a = iter(loader)
    first = next(a)
    b = iter(loader)
    return [first, *a, *b]


def _samples(batches):
    """The sample indices of Augmented batches (or tuples of them)."""
    if isinstance(batches, (list, tuple)):
        return [_samples(b) for b in batches]
    return batches["pair"][0]


@pytest.mark.parametrize("device", [None, pytest.param("cpu", marks=pytest.mark.slow)])
# "cpu": batches come from a thread
@pytest.mark.parametrize("persistent", [pytest.param(False, marks=pytest.mark.slow), True])
def test_live_iterators_of_one_loader_behave_as_torchs_and_never_hang(persistent, device):
    reference, ours = both(num_workers=2, batch_size=4, shuffle=True,
                           persistent_workers=persistent, timeout=20)
    ours.device = torch.device(device) if device else None
    try:
        for use in (_interleaved, _zipped, _peek_then_loop, _old_after_new):
            _seed_globals(0)
            expected = use(reference)
            _seed_globals(0)
            got = use(ours)
            assert len(got) == len(expected), use.__name__
            if persistent:  # the same samples; the noise of workers that went on from an
                # epoch left early depends on how far they had got (see the docstring)
                expected, got = _samples(expected), _samples(got)
            assert all(same(a, b) for a, b in zip(expected, got, strict=True)), use.__name__
            gc.collect()
            # Without persistent workers a pass's workers stop when it ends or is dropped.
            assert bool(psutil.Process().children()) == persistent, use.__name__
    finally:
        ours.close()


class Scaled(torch.utils.data.Dataset):
    """A dataset the user changes between epochs."""

    def __init__(self) -> None:
        self.scale = 1

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        return torch.tensor(i * self.scale)


@pytest.mark.parametrize("persistent", [False, True])
def test_dataset_changes_between_epochs_reach_the_next_epoch_as_in_torch(persistent):
    results = []
    for cls in (torch.utils.data.DataLoader, zt.DataLoader):
        dataset = Scaled()
        loader = cls(dataset, batch_size=5, num_workers=2, persistent_workers=persistent)
        try:
            first = [b.tolist() for b in loader]
            dataset.scale = 2
            results.append((first, [b.tolist() for b in loader]))
        finally:
            if isinstance(loader, zt.DataLoader):
                loader.close()
    assert results[0] == results[1]
    first, second = results[1]
    # torch re-creates its workers each epoch; persistent ones keep the copy they took.
    assert second == (first if persistent else [[2 * x for x in b] for b in first])


class Noisy(torch.utils.data.Dataset):
    """Every sample is random: torch, numpy and random draws of the worker's RNGs."""

    def __len__(self) -> int:
        return 22

    def __getitem__(self, i: int):
        return torch.rand(1) + float(np.random.rand()) + random.random() + i


@pytest.mark.parametrize("persistent", [False, True])
def test_load_state_dict_resumes_the_workers_random_state(persistent):
    def loader():
        return zt.DataLoader(Noisy(), batch_size=2, shuffle=True, num_workers=2,
                             persistent_workers=persistent,
                             generator=torch.Generator().manual_seed(5))

    at_epoch, at_batch = (1, 3) if persistent else (0, 3)  # odd: worker 1 makes batch 3
    original = loader()
    epochs = []
    try:
        for epoch in range(at_epoch + 2):
            batches = []
            for batch in original:
                batches.append(batch)
                if (epoch, len(batches)) == (at_epoch, at_batch):
                    state = json.loads(json.dumps(original.state_dict()))
            epochs.append(batches)
    finally:
        original.close()
    resumed = loader()
    try:
        resumed.load_state_dict(state)
        rest, following = list(resumed), list(resumed)
    finally:
        resumed.close()
    assert len(rest) == len(epochs[at_epoch]) - at_batch
    assert all(torch.equal(a, b) for a, b in zip(rest, epochs[at_epoch][at_batch:],
                                                 strict=True))
    assert all(torch.equal(a, b) for a, b in zip(following, epochs[at_epoch + 1],
                                                 strict=True))


@pytest.mark.slow
def test_a_broker_s_workers_make_the_batches_and_num_workers_0_there_is_refused():
    with pytest.raises(ValueError, match="num_workers=0 loads in this process"):
        zt.DataLoader(Augmented(), num_workers=0, broker="tcp://127.0.0.1:5555")
    from tests.service import service

    with service(workers=2) as (address, _):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        reference = torch.utils.data.DataLoader(
            Augmented(), batch_size=4, shuffle=True, num_workers=2,
            generator=torch.Generator().manual_seed(0))
        ours = zt.DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2,
                             broker=address, timeout=30,
                             generator=torch.Generator().manual_seed(0))
        try:
            for _ in range(2):  # each epoch a job of its own, on the same two workers
                got = []
                for batch in ours:
                    if not got:  # this process started none: the broker's two serve
                        now = {p.pid for p in psutil.Process().children(recursive=True)}
                        assert now <= before
                    got.append(batch)
                expected = list(reference)
                assert all(same(a, b) for a, b in zip(expected, got, strict=True))
                assert ours.stats()["elements"] == len(got)  # this pass's, once it ended
        finally:
            ours.close()


class _Indices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(3))
def test_a_persistent_worker_paused_for_a_few_seconds_does_not_stall_the_epoch(attempt):
    """A worker SIGSTOPped for 3.5 s (longer than the broker's 3 heartbeats) and resumed:
    the epoch goes on with torch's batches. It used to time out about half the time: a
    worker stopped before it read its TASK reconnected on waking, which dropped that TASK
    with the old connection, and the broker, keeping the task, never sent it again."""
    import os
    import signal
    import threading
    import time

    loader = zt.DataLoader(_Indices(), batch_size=512, num_workers=2,
                           persistent_workers=True, timeout=20)
    waking = None
    try:
        batches = iter(loader)
        first = next(batches)
        pid = loader._service._processes[0].pid
        os.kill(pid, signal.SIGSTOP)
        waking = threading.Timer(3.5, os.kill, (pid, signal.SIGCONT))
        waking.start()
        start = time.monotonic()
        seen = [first, *batches]
        assert torch.cat(seen).tolist() == list(range(100_000))  # in order, each once
        assert time.monotonic() - start < 60
    finally:
        if waking is not None:
            waking.join()  # the worker runs again before the loader stops it
        loader.close()


PAUSED_TRAINER = """
import json, time, torch, zloader.torch

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 3000

    def __getitem__(self, i):
        time.sleep(0.001)
        return i

loader = zloader.torch.DataLoader(Slow(), batch_size=8, num_workers=2, broker={address!r},
                                  timeout=30, in_order={in_order})
seen = []
for i, batch in enumerate(loader):
    seen += batch.tolist()
    if i == 20:
        print("reading", flush=True)
print(json.dumps(seen), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("in_order", [True, False])
def test_a_trainer_stopped_past_its_expiry_on_a_broker_gets_each_batch_once(in_order):
    """SIGSTOP a drop-in trainer on a broker longer than 3 heartbeats: the broker gives up
    on it and its workers drop its streams, with the batches they held. On SIGCONT it
    registers again and sends each worker the batches it had handed it and not received
    (Loader.dispatch_done forgets those received), the workers drop what they still held
    of them (OPEN.redispatched), and a batch made twice is yielded once. Before: both
    orders timed out (the workers waited for batches never sent again)."""
    from tests.service import HEARTBEAT, service
    from tests.test_exactly_once import _paused

    with service(workers=2) as (address, _):
        out = _paused(PAUSED_TRAINER.format(address=address, in_order=in_order),
                      4 * HEARTBEAT)
    seen = json.loads(out)
    if in_order:
        assert seen == list(range(3000))
    else:
        assert sorted(seen) == list(range(3000))


class Numbers(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> int:
        return i


def _stop_the_last_worker_as_it_forks(workers: int, stopped: list[int]) -> None:
    """SIGSTOP the last of this process's ``workers`` workers (the descendants that fork
    none) as soon as it exists, before it can start; its pid goes in ``stopped``."""
    import os
    import signal
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            leaves = [p for p in psutil.Process().children(recursive=True)
                      if not p.children()]
        except psutil.NoSuchProcess:
            continue
        if len(leaves) >= workers:
            pid = max(leaves, key=lambda p: (p.create_time(), p.pid)).pid
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            return
        time.sleep(0.0005)


@pytest.mark.parametrize("in_order", [True, False])
def test_the_first_batch_does_not_wait_for_the_other_workers_to_start(in_order):
    """Batch 0 is worker 0's: it comes while worker 2 is stopped from its fork on (each
    worker's start snapshot comes with its first batch; ``iter()`` waits for the starts
    only where ``worker_init_fn`` may fail), and the epoch is whole once it goes on."""
    import contextlib
    import os
    import signal
    import threading

    loader = zt.DataLoader(Numbers(), batch_size=4, num_workers=3, timeout=20,
                           in_order=in_order)
    stopped: list[int] = []
    stopper = threading.Thread(target=_stop_the_last_worker_as_it_forks, args=(3, stopped))
    stopper.start()
    try:
        epoch = iter(loader)
        stopper.join()
        assert stopped and stopped[0] == epoch._workers[2].pid
        try:
            head = [next(epoch).tolist() for _ in range(2 if in_order else 8)]
        finally:
            os.kill(stopped[0], signal.SIGCONT)
        if in_order:
            assert head == [[0, 1, 2, 3], [4, 5, 6, 7]]
        batches = head + [batch.tolist() for batch in epoch]
        assert sorted(batches) == [list(range(i, i + 4)) for i in range(0, 48, 4)]
    finally:
        stopper.join()
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):  # (gone with the epoch's end)
                os.kill(pid, signal.SIGCONT)
        loader.close()


def test_a_validation_loader_on_a_pool_whose_train_loader_holds_workers_mid_epoch():
    """A training loop that validates mid-epoch, both loaders on one pool of 3 workers: the
    persistent train loader's static job keeps its 2 workers until its epoch ends, so the
    2-worker validation loader gets 1 and times out naming the index without a worker
    (not the served worker's silence: docs/reliability.md, "Not yet"), and the train
    loader's epoch goes on whole."""
    from tests.service import service

    with service(workers=3) as (address, _):
        train = zt.DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2,
                              persistent_workers=True, broker=address, timeout=30,
                              generator=torch.Generator().manual_seed(5))
        expected = list(torch.utils.data.DataLoader(
            Augmented(), batch_size=4, shuffle=True, num_workers=2,
            generator=torch.Generator().manual_seed(5)))
        try:
            got = []
            for step, batch in enumerate(train):
                got.append(batch)
                if step == 2:
                    reason = _timed_out(zt.DataLoader(Augmented(), batch_size=5,
                                                      num_workers=2, broker=address,
                                                      timeout=2))
                    assert "worker index 1 of this job's 2 has no worker" in reason
                    assert "other workers run other jobs" in reason
            assert all(same(a, b) for a, b in zip(expected, got, strict=True))
        finally:
            train.close()


def _timed_out(loader: zt.DataLoader) -> str:
    """Read ``loader``'s epoch, which must end in torch's Timeout ("DataLoader timed out
    after N seconds"), then close it; the cause's message: zloader's reason."""
    try:
        with pytest.raises(Timeout, match=f"timed out after {loader.timeout:g} seconds") \
                as caught:
            list(loader)
    finally:
        loader.close()
    return str(caught.value.__cause__)


def test_a_pool_smaller_than_num_workers_names_the_index_without_a_worker():
    """A 2-worker DataLoader on a pool of 1: the Timeout says which index has no worker."""
    from tests.service import service

    with service(workers=1) as (address, _):
        reason = _timed_out(zt.DataLoader(Augmented(), batch_size=5, num_workers=2,
                                          broker=address, timeout=2))
        assert "worker index 1 of this job's 2 has no worker" in reason
        assert "no free worker" in reason


class _FailingSampler(torch.utils.data.Sampler):
    """A sampler whose first pull raises (as one reading a missing index file would)."""

    def __init__(self) -> None:
        pass

    def __len__(self) -> int:
        return 10

    def __iter__(self):
        raise RuntimeError("the sampler's index file is missing")
        yield 0  # (a generator: it raises at its first pull, not at iter())


@pytest.mark.parametrize("persistent", [False, True])
def test_a_sampler_failing_at_its_first_pull_raises_its_error_and_stops_the_workers(
        persistent: bool):
    """The workers start before the sampler's first pull, as torch's do: when that pull
    raises, the error is the sampler's, and the workers started for the pass are
    stopped (the leak check after each test finds none), or, persistent, kept for the
    next pass, which works once the sampler does."""
    sampler = _FailingSampler()
    loader = zt.DataLoader(list(range(10)), sampler=sampler, batch_size=2, num_workers=3,
                           persistent_workers=persistent, timeout=30)
    with pytest.raises(RuntimeError, match="index file is missing"):
        next(iter(loader))
    # (a pass's own workers gone at once; the persistent ones kept for the next pass)
    assert bool(psutil.Process().children()) == persistent
    sampler.__class__ = torch.utils.data.SequentialSampler
    sampler.data_source = loader.dataset
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    loader.close()


def test_a_pass_that_fails_while_planning_its_workers_stops_them(monkeypatch):
    """A failure after the pass's workers started but before they were opened (here the
    planning of each worker's part; a Ctrl-C there too) stops them at once, not when the
    error and its traceback are let go of."""
    from zloader.torch import dataloader as module

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("planning failed")

    monkeypatch.setattr(module, "worker_plans", fail)
    loader = zt.DataLoader(list(range(10)), batch_size=2, num_workers=2, timeout=30)
    with pytest.raises(RuntimeError, match="planning failed") as caught:
        next(iter(loader))
    assert caught.tb is not None  # (the error and its frames are still held here)
    assert not psutil.Process().children()


NO_INIT_WHEN_CLOSED = """
import os, sys, time, torch, zloader.torch as zt
os.register_at_fork(after_in_child=lambda: time.sleep(0.3))  # each worker starts late
marks = sys.argv[1]
def init(worker):
    open(os.path.join(marks, str(os.getpid())), "w").close()
class Failing(torch.utils.data.Sampler):
    def __init__(self):
        pass
    def __len__(self):
        return 4
    def __iter__(self):
        raise RuntimeError("sampler failed")
        yield 0
loader = zt.DataLoader(list(range(4)), sampler=Failing(), num_workers=2,
                       worker_init_fn=init, timeout=30)
try:
    next(iter(loader))
except RuntimeError as exc:
    print(exc)
"""


def test_workers_stopped_before_they_start_run_no_worker_init_fn(tmp_path):
    """Workers that their pass stops while they start (its sampler failed at once) leave
    without running the user's ``worker_init_fn``: the stop is looked at before it."""
    done = subprocess.run([sys.executable, "-c", NO_INIT_WHEN_CLOSED, str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "sampler failed"
    assert os.listdir(tmp_path) == []
