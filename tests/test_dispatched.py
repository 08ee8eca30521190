"""A worker's dispatched work items (zloader/worker/dispatched.py): the queue between the
socket thread that receives DISPATCH and the producer thread that takes them."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

import zloader
from tests.service import wait_for
from zloader._defaults import MAX_DISPATCHED
from zloader.client.peers import Peers
from zloader.sources import Source
from zloader.transport.protocol import Command, ProtocolError
from zloader.worker.dispatched import Dispatched
from zloader.worker.task import keep_latest


def test_items_come_in_order_then_none_once_the_consumer_ends_them():
    queue, stop = Dispatched(), threading.Event()
    queue.put((3, 1))
    queue.put((4,))
    queue.put(())  # no more
    assert [queue.take(stop) for _ in range(4)] == [3, 1, 4, None]


def test_a_waiting_take_gets_an_item_put_from_another_thread():
    queue, stop = Dispatched(), threading.Event()
    got: list[int | None] = []
    taker = threading.Thread(target=lambda: got.append(queue.take(stop)))
    taker.start()
    queue.put((7,))
    taker.join(10)
    assert not taker.is_alive() and got == [7]


def test_a_stopped_producer_stops_waiting():
    queue, stop = Dispatched(), threading.Event()
    got: list[int | None] = []
    taker = threading.Thread(target=lambda: got.append(queue.take(stop)))
    taker.start()
    stop.set()
    taker.join(10)  # does not hang: the wait looks at the stop
    assert not taker.is_alive() and got == [None]


def test_a_flood_of_items_is_refused_and_loses_none_already_queued():
    queue, stop = Dispatched(), threading.Event()
    queue.put(tuple(range(MAX_DISPATCHED - 1)))
    with pytest.raises(ProtocolError, match=r"more than \d+ work items"):
        queue.put((1, 2))
    queue.put((5,))
    assert queue.take(stop) == 0


def test_a_task_keeps_the_two_latest_epochs_whatever_order_they_come_in():
    """Epoch inputs and dispatched items, keyed by epoch: a consumer counting epochs down
    (hostile, or confused) cannot make a worker keep one per epoch."""
    by_epoch: dict[int, str] = {}
    for epoch in (5, 4, 3, 2, 1, 0, 9, 8):
        by_epoch[epoch] = "x"
        keep_latest(by_epoch)
        assert len(by_epoch) <= 2
    assert sorted(by_epoch) == [8, 9]


@dataclass(frozen=True, eq=False, kw_only=True)
class Squares(Source):
    """One split per worker; each work item ``i`` dispatched to a worker makes ``i * i``."""

    kind: ClassVar[str] = "squares_dispatched"
    width: int = 2

    @property
    def num_splits(self) -> int:
        return self.width

    @property
    def dispatched(self) -> bool:
        return True

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.width)

    def read(self, split: int, policy: Any = None) -> Iterator[Any]:
        take = policy.settings.dispatched
        while (item := take()) is not None:
            yield {"worker": policy.settings.worker, "square": item * item}


def test_items_dispatched_before_the_workers_are_up_reach_them_in_order():
    """Items dispatched right after iterate(), before any worker is connected (kept for
    its OPEN by the consumer, and by the worker until its task starts), all arrive, each
    made by the worker it was sent to; an empty dispatch ends each worker's epoch."""
    source = Squares(name="squares", shuffle_splits=False, seed=None, version=None)
    with zloader.Loader(zloader.Pipeline(source), num_workers=2, sharding="static",
                        timeout=30) as loader:
        for epoch in range(2):
            elements = loader.iterate()
            for worker in (0, 1):
                loader.dispatch(worker, [i for i in range(40) if i % 2 == worker])
                loader.dispatch(worker, [])
            got = sorted((e["square"], e["worker"]) for e in elements)
            assert got == sorted((i * i, i % 2) for i in range(40)), epoch
        with pytest.raises(ValueError, match="items must be >= 0"):
            loader.dispatch(0, [-1])


def test_credits_given_back_go_with_the_next_items_to_the_same_worker():
    """A consumer that dispatches a worker its next item as it takes the last one's
    element (as the torch drop-in hands out batches) gives that record's credit back in
    the same DISPATCH, not in a CREDIT of its own; with one credit per worker, every
    element comes (a credit lost on the way would stop the worker: Timeout)."""
    source = Squares(name="squares", shuffle_splits=False, seed=None, version=None)
    sent: Counter[str] = Counter()
    send = Peers.send

    def counted(self: Peers, peer: Any, command: Command, body: Any, payload: Any = ()) -> None:
        sent[command.name + ("+credits" if command == Command.DISPATCH and body.get("credits")
                             else "")] += 1
        send(self, peer, command, body, payload)

    Peers.send = counted  # type: ignore[method-assign]
    try:
        with zloader.Loader(zloader.Pipeline(source), num_workers=2, sharding="static",
                            prefetch=1, timeout=10) as loader:
            elements = loader.iterate()
            for worker in (0, 1):
                loader.dispatch(worker, [worker])
            got, item = [], 2
            for element in elements:  # (the next item to the worker whose element it is)
                got.append(element["square"])
                if item < 40:
                    loader.dispatch(element["worker"], [item])
                elif item == 40:  # (none follow: each worker's epoch ends)
                    loader.dispatch(0, [])
                    loader.dispatch(1, [])
                item += 1
            assert sorted(got) == [i * i for i in range(40)]
    finally:
        Peers.send = send  # type: ignore[method-assign]
    assert sent["DISPATCH+credits"] >= 30, sent
    assert sent["CREDIT"] <= 10, sent


@pytest.mark.parametrize("until_done", [False, True])
def test_items_kept_until_done_are_forgotten_once_done_and_others_are_never_kept(until_done):
    """dispatch(..., until_done=True) keeps items (to send again should the worker's
    stream of them be lost) until dispatch_done says they are done; others are not kept:
    a Loader that never calls dispatch_done keeps nothing of an epoch's items."""
    source = Squares(name="squares", shuffle_splits=False, seed=None, version=None)
    with zloader.Loader(zloader.Pipeline(source), num_workers=2, sharding="static",
                        timeout=30) as loader:
        elements = loader.iterate()
        for worker in (0, 1):
            loader.dispatch(worker, [i for i in range(40) if i % 2 == worker],
                            until_done=until_done)
            loader.dispatch(worker, [], until_done=until_done)
        got = []
        for element in elements:
            got.append(element["square"])
            if until_done:
                loader.dispatch_done(element["worker"], 1)
        assert sorted(got) == [i * i for i in range(40)]
        loader._io.loop.wake()  # (its next step takes the last dispatch_done)
        kept = loader._io.loop._session.dispatch_kept
        want = {0: [[]], 1: [[]]} if until_done else {}  # (each worker's end of items)
        wait_for(lambda: {i: list(items) for i, items in kept.items()} == want, 10)
