"""The consumer's turn (zloader/client/thread.py): the iterating thread reads the sockets
itself while it waits for data, and the I/O thread reads them while the trainer is away.
Real brokers, workers and sockets; each test would fail if one side stopped serving."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
from service import HEARTBEAT, start_broker, start_worker, status, stop

from zloader import Loader, Pipeline
from zloader._defaults import LEND_SECONDS


def _slow(index: int) -> int:
    time.sleep(0.002)
    return index


def test_a_trainer_away_longer_than_the_lend_time_gets_every_element_once() -> None:
    """Pauses longer than LEND_SECONDS hand the sockets to the I/O thread (it reads ahead),
    and the next wait takes them back: two epochs, nothing lost or repeated."""
    with Loader(Pipeline.range(240).map(_slow), num_workers=2, timeout=60) as loader:
        for _ in range(2):
            got = []
            for n, element in enumerate(loader):
                got.append(element)
                if n % 20 == 0:
                    time.sleep(3 * LEND_SECONDS)
            assert sorted(got) == list(range(240))
        assert loader.stats()["rejected"] == 0


@pytest.mark.slow  # (over 3 s: the fast suite keeps to 6 minutes on 2 cores)
def test_a_consumer_waiting_for_data_keeps_beating_and_gets_it_when_a_worker_comes() -> None:
    """A trainer blocked in next() holds the sockets: its heartbeats still reach the
    broker (which drops a consumer silent for 3 heartbeats), and a worker that starts
    later serves it."""
    broker, address = start_broker()
    worker = None
    result: dict[str, Any] = {}
    try:
        with Loader(Pipeline.range(60), broker=address, num_workers=0, timeout=60) as loader:
            iterator = iter(loader)
            reader = threading.Thread(target=lambda: result.setdefault("got", list(iterator)))
            reader.start()
            time.sleep(5 * HEARTBEAT)  # (silent for 3 heartbeats: dropped)
            body = status(address)
            assert body is not None
            assert [job["consumers"] for job in body["jobs"]] == [1]
            worker = start_worker(address)
            reader.join(60)
            assert not reader.is_alive()
        assert sorted(result["got"]) == list(range(60))
    finally:
        if worker is not None:
            stop(worker)
        stop(broker)


def test_closing_the_loader_from_another_thread_ends_a_waiting_iterator() -> None:
    """close() on another thread while the iterating thread waits (holding the sockets):
    the iterator raises at once, saying the Loader was closed, and nothing leaks."""
    broker, address = start_broker()
    errors: list[BaseException] = []
    try:
        loader = Loader(Pipeline.range(10), broker=address, num_workers=0, timeout=60)
        iterator = iter(loader)

        def read() -> None:
            try:
                list(iterator)
            except RuntimeError as exc:
                errors.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(1.0)
        started = time.monotonic()
        loader.close()
        reader.join(10)
        assert not reader.is_alive(), "the iterator still waits after close()"
        assert time.monotonic() - started < 10
        assert len(errors) == 1 and "closed" in str(errors[0])
    finally:
        stop(broker)


@pytest.mark.parametrize("deterministic", [False, True])
def test_two_loaders_iterated_in_turns_from_one_thread(deterministic: bool) -> None:
    """A train and a validation Loader read alternately by one thread: each takes its
    own sockets in turn; both get all their elements."""
    with Loader(Pipeline.range(100).map(_slow), num_workers=2, timeout=60,
                deterministic=deterministic) as train, \
            Loader(Pipeline.range(1000, 1040), num_workers=1, timeout=60) as validation:
        got: list[int] = []
        checks: list[int] = []
        for n, element in enumerate(train):
            got.append(element)
            if n % 50 == 49:
                checks.extend(validation)
        assert sorted(got) == list(range(100))
        assert sorted(checks) == sorted(list(range(1000, 1040)) * 2)


_TRAINER = os.getpid()


class _SlowToDecode:
    """A batch whose unpickling in the trainer takes STALL_SECONDS once (as a batch of
    many objects, or a finalizer the collector runs there, does)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return _decoded, (self.value,)


STALL_SECONDS = 4.0  # (the embedded broker's expiry: 3 heartbeats of 1 s)


def _decoded(value: int) -> _SlowToDecode:
    if os.getpid() == _TRAINER and value == 12:
        time.sleep(STALL_SECONDS)
    return _SlowToDecode(value)


def _first(batch: list[int]) -> _SlowToDecode:
    return _SlowToDecode(batch[0])


def test_a_trainer_whose_loop_is_held_past_its_heartbeats_keeps_its_epoch() -> None:
    """A batch decoding for longer than the broker's expiry holds the trainer's loop (no
    heartbeat goes out): a consumer on the broker's host still running is kept, as a busy
    worker is (before: dropped, and the drop-in waited out its timeout for batches it
    had dispatched, then raised Timeout)."""
    torch = pytest.importorskip("torch")
    from zloader.torch import DataLoader

    class Numbers(torch.utils.data.Dataset):  # type: ignore[misc,type-arg]
        def __len__(self) -> int:
            return 40

        def __getitem__(self, index: int) -> int:
            return index

    loader = DataLoader(Numbers(), batch_size=4, num_workers=2, collate_fn=_first,
                        timeout=30)
    assert [batch.value for batch in loader] == list(range(0, 40, 4))
