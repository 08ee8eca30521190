"""A worker's dispatched work items (zloader/worker/dispatched.py): the queue between the
socket thread that receives DISPATCH and the producer thread that takes them."""

from __future__ import annotations

import threading

import pytest

from zloader._defaults import MAX_DISPATCHED
from zloader.transport.protocol import ProtocolError
from zloader.worker.dispatched import Dispatched


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
