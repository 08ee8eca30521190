"""Credits given back in the rings' headers (transport/ring.py, docs/protocol.md "Flow
control"): a co-located consumer that keeps up with its worker gives its credits back
without a message; one that falls behind wakes the worker waiting for them with a CREDIT,
one per CREDIT's worth of credits given back (never one per credit); a ring that grows,
and records that go in segments of their own, keep every element, once and in order. Real
Loaders and workers; the test counts the CREDIT messages the consumer sends."""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import pytest

from tests.service import run_together, service
from zloader import Loader, Pipeline
from zloader.client.peers import Peers
from zloader.transport.protocol import Command


@pytest.fixture
def credits_sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The bodies of the CREDIT messages consumers of this process send."""
    sent: list[dict[str, Any]] = []
    send = Peers.send

    def counting(self: Peers, peer: Any, command: Command, body: dict[str, Any],
                 payload: Any = ()) -> None:
        if command is Command.CREDIT:
            sent.append(dict(body))
        send(self, peer, command, body, payload)

    monkeypatch.setattr(Peers, "send", counting)
    return sent


def paced(seconds: float) -> Any:
    def element(x: int) -> int:
        time.sleep(seconds)
        return x
    return element


def test_a_consumer_that_keeps_up_gives_its_credits_back_without_messages(credits_sent):
    # (prefetch 2: a CREDIT message per record without the ring's words)
    with Loader(Pipeline.range(200).map(paced(0.005)), num_workers=1, prefetch=2,
                timeout=60) as loader:
        assert list(loader) == list(range(200))
    # Without the ring's words each record's credit would go in a CREDIT of 1; the only
    # CREDITs now are wakes of a worker that waited for credits (now and then, on a busy
    # host), which carry none.
    assert all(body["credits"] == 0 for body in credits_sent), credits_sent[:3]


def megabyte(x: int) -> np.ndarray:
    """An element that fills a record alone (RECORD_BYTES), made in well under 1 ms."""
    return np.full(1 << 17, x, np.int64)


def read_slowly(loader: Loader) -> list[int]:
    """Each element's first value, 4 ms of the consumer's time per element (slower than
    its worker makes them)."""
    got = []
    for element in loader:
        got.append(int(element[0]))
        time.sleep(0.004)
    return got


def test_a_consumer_slower_than_its_worker_wakes_it_once_per_credits_worth(credits_sent):
    # (prefetch 4: a CREDIT's worth is 2; a worker that makes a record in a fraction of
    # the consumer's 4 ms per element waits for credits again and again)
    with Loader(Pipeline.range(120).map(megabyte), num_workers=1, prefetch=4,
                timeout=60) as loader:
        got = read_slowly(loader)
    assert got == list(range(120))
    assert credits_sent, "the waiting worker was never woken: it ran on its timeouts"
    assert len(credits_sent) <= 120 // 2 + 2, len(credits_sent)


def test_a_waiting_worker_is_woken_once_per_credits_worth_not_per_credit(monkeypatch):
    """Between two wakes of a waiting worker (a CREDIT carrying no credits), the consumer
    gives back at least a CREDIT's worth of credits through the ring's header: the worker
    wakes to make several records, not one per credit."""
    events: list[int | None] = []  # credits given back, None for a wake
    credit, send = Peers.credit, Peers.send

    def giving(self: Peers, worker: str, credits: int, part: Any = None) -> None:
        events.append(credits)
        credit(self, worker, credits, part)

    def sending(self: Peers, peer: Any, command: Command, body: dict[str, Any],
                payload: Any = ()) -> None:
        if command is Command.CREDIT and body["credits"] == 0 and not body["mapped"]:
            events.append(None)
        send(self, peer, command, body, payload)

    monkeypatch.setattr(Peers, "credit", giving)
    monkeypatch.setattr(Peers, "send", sending)
    # (prefetch 16: a CREDIT's worth is 8; the worker makes a record in a fraction of the
    # consumer's 4 ms per element, and waits for credits again and again)
    with Loader(Pipeline.range(240).map(megabyte), num_workers=1, prefetch=16,
                timeout=60) as loader:
        got = read_slowly(loader)
        worth = loader._io.loop.budget.credit_batch
    assert got == list(range(240))
    assert worth == 8
    between, given = [], 0
    for event in events:
        if event is None:
            between.append(given)
            given = 0
        else:
            given += event
    assert between, "the waiting worker was never woken: it ran on its timeouts"
    assert min(between) >= worth, between


def sized(x: int) -> np.ndarray:
    """150 KB, and every 40th element from the first 1.5 MB: larger than a 1 MiB ring (a
    segment). (The first: a ring that grew before the first large one, as one that
    filled on a busy host does, would have held them all, and no segment was sent: the
    suite's pure run failed so once.)"""
    return np.full(375_000 if x % 40 == 0 else 37_500, x, np.int32)


def test_a_grown_ring_and_segments_keep_the_credits_flowing(credits_sent):
    with Loader(Pipeline.range(160).map(sized), num_workers=1, prefetch=2,
                ring_bytes=1 << 20, timeout=60) as loader:
        got = [(int(element[0]), len(element)) for element in loader]
    assert got == [(x, len(sized(x))) for x in range(160)]
    # segments were let go of (CREDIT.mapped; the first before the ring grew to hold
    # such records; until the worker takes its credits from the grown ring's header,
    # CREDITs carry them)
    assert sum(len(body["mapped"]) for body in credits_sent) >= 1


def test_two_workers_and_a_second_epoch_count_afresh(credits_sent):
    with Loader(Pipeline.range(300, split_size=10).map(paced(0.001)), num_workers=2,
                prefetch=2, timeout=60) as loader:
        for _ in range(2):  # (each epoch's OPEN numbers the count anew)
            assert sorted(loader) == list(range(300))


def test_records_dealt_to_a_slow_consumer_wait_for_its_credits(credits_sent):
    """Balanced: the records of a consumer that reads slowly wait in the worker for its
    credits (the other's do not help); the worker says so in the ring's header, and that
    consumer wakes it once it has given back a CREDIT's worth: equal shares, all of it."""
    with service(workers=1) as (address, _):
        loaders = [Loader(Pipeline.range(120, split_size=10), broker=address, timeout=30,
                          job_name="dealt-slow", balanced=2, prefetch=4) for _ in range(2)]
        got: list[list[int]] = [[], []]

        def read(which: int) -> None:
            for element in loaders[which]:
                got[which].append(int(element))
                if which:
                    time.sleep(0.004)

        try:
            run_together([functools.partial(read, 0), functools.partial(read, 1)], 60)
        finally:
            for loader in loaders:
                loader.close()
    assert sorted(got[0] + got[1]) == list(range(120))
    assert abs(len(got[0]) - len(got[1])) <= 1
