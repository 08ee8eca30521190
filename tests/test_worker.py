"""The worker's delivery modes, driven in-process: a real broker process, real
:class:`~zloader.worker.WorkerProcess` objects whose loops run on threads of this process
(real loopback sockets, real shared-memory rings), and real Loaders as consumers. They guard
the worker's code paths one mode at a time: credit delivery (plain and balanced), rounds
(coordinated reads), shared delivery, exactly-once, static sharding, and the drain. Then the
producer thread alone, on a real inproc link."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from tests.service import read_together, start_broker, status, stop, wait_for
from zloader import Loader, Pipeline
from zloader._defaults import MAX_AHEAD
from zloader.codec import decode
from zloader.options import JobOptions
from zloader.plan import plan
from zloader.transport import messages
from zloader.transport.messages import Ready, Split, SplitReq
from zloader.transport.protocol import decode as decode_message
from zloader.worker import WorkerProcess
from zloader.worker.broker_link import BrokerLink
from zloader.worker.permits import Pool
from zloader.worker.producer import LinkKind, Producer, ProducerSpec, SplitAnswer

JOIN_SECONDS = 10.0


class Running:
    """A WorkerProcess whose loop runs on a thread of this process."""

    def __init__(self, address: str) -> None:
        self.worker = WorkerProcess(address, "tcp://127.0.0.1:*", heartbeat=0.5)
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:  # reported by close
            self.errors.append(exc)

    def close(self) -> None:
        self.worker.stop.set()
        self.thread.join(JOIN_SECONDS)
        assert not self.thread.is_alive(), "the worker's loop did not end"
        assert not self.errors, self.errors


@contextlib.contextmanager
def in_process(workers: int = 1) -> Iterator[tuple[str, list[Running]]]:
    """A broker process and ``workers`` in-process workers registered with it."""
    broker, address = start_broker()
    running: list[Running] = []
    try:
        running = [Running(address) for _ in range(workers)]
        wait_for(lambda: status(address, 1.0) is not None, what="the broker")
        wait_for(lambda: len(status(address)["workers"]) == workers, what="the workers")
        yield address, running
    finally:
        for worker in running:
            worker.close()
        stop(broker)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("exactly_once", [True, False])
def test_credit_delivery_yields_every_element_once_per_epoch(transport, exactly_once):
    pipeline = Pipeline.range(500, split_size=20).map(lambda x: np.full(64, x))
    with in_process(workers=2) as (address, running):
        with Loader(pipeline, broker=address, transport=transport, timeout=30,
                    exactly_once=exactly_once, prefetch=2) as loader:
            for _ in range(2):
                got = [int(v[0]) for v in loader]
                assert sorted(got) == list(range(500))
        assert sum(r.worker.port.outlet.elements for r in running) == 1000


def first_int(value: Any) -> int:
    """An element (a number, or an array holding one) as an int."""
    return int(np.asarray(value).ravel()[0])


def test_balanced_delivery_deals_equal_shares():
    pipeline = Pipeline.range(300, split_size=10)
    with in_process(workers=2) as (address, _):
        loaders = [Loader(pipeline, broker=address, job_name="dealt", balanced=2,
                          timeout=30) for _ in range(2)]
        try:
            results = read_together(loaders, epochs=2, element=first_int)
        finally:
            for loader in loaders:
                loader.close()
    for epoch in range(2):
        got = [r[epoch] for r in results]
        assert sorted(got[0] + got[1]) == list(range(300))
        assert abs(len(got[0]) - len(got[1])) <= 2  # one element per worker at most


def test_rounds_delivery_gives_each_round_to_every_consumer_from_one_worker():
    n, rounds = 2, 30
    pipeline = Pipeline.range(n * rounds, split_size=n)  # a split is one round's group
    with in_process(workers=2) as (address, _):
        loaders = [Loader(pipeline, broker=address, job_name="rounds", num_consumers=n,
                          consumer_index=i, timeout=30) for i in range(n)]
        try:
            results = read_together(loaders, epochs=2, element=first_int)
        finally:
            for loader in loaders:
                loader.close()
    for epoch in range(2):
        sequences = [r[epoch] for r in results]
        assert len(sequences[0]) == len(sequences[1]) == rounds
        for step in zip(*sequences, strict=True):  # one round: one group, element j to j
            assert [v // n for v in step] == [step[0] // n] * n
            assert [v % n for v in step] == list(range(n))
        assert sorted(sequences[0] + sequences[1]) == list(range(n * rounds))


def test_shared_delivery_gives_every_trainer_every_element_made_once():
    pipeline = Pipeline.range(200, split_size=10).map(lambda x: np.full(512, x))
    with in_process(workers=1) as (address, running):
        loaders = [Loader(pipeline, broker=address, share=True, timeout=30, prefetch=2)
                   for _ in range(2)]
        try:
            wait_for(lambda: any(j["consumers"] == 2 for j in status(address)["jobs"]),
                     what="both trainers on one shared job")
            results = read_together(loaders, epochs=2, element=first_int)
        finally:
            for loader in loaders:
                loader.close()
        for result in results:
            for epoch in result:
                assert sorted(epoch) == list(range(200))
        assert running[0].worker.port.outlet.elements == 2 * 2 * 200  # each trainer, each epoch


def test_static_sharding_gives_each_worker_its_index():
    pipeline = Pipeline.range(240, split_size=10)
    with in_process(workers=2) as (address, running):
        with Loader(pipeline, broker=address, sharding="static", timeout=30) as loader:
            assert sorted(loader) == list(range(240))
        assert sorted(r.worker.port.outlet.elements for r in running) == [120, 120]


def test_a_drained_worker_loses_and_repeats_nothing():
    pipeline = Pipeline.range(3000, split_size=50).map(lambda x: np.full(16, x))
    with in_process(workers=2) as (address, running):
        with Loader(pipeline, broker=address, timeout=30, prefetch=2) as loader:
            got = []
            for element in loader:
                got.append(int(element[0]))
                if len(got) == 300:
                    running[0].worker.drain()
            running[0].thread.join(JOIN_SECONDS)
            assert not running[0].thread.is_alive(), "the drained worker did not leave"
            assert sorted(got) == list(range(3000))
            assert sorted(int(v[0]) for v in loader) == list(range(3000))  # one worker left


# --- the producer, on a real link -----------------------------------------------------------


Receive = Callable[[], tuple[LinkKind, Any, list[int] | None]]


@contextlib.contextmanager
def producer_link(pipeline: Pipeline, sharding: str, **options: Any
                  ) -> Iterator[tuple[Pool, Any, Receive, Producer]]:
    """A producer of epoch 0 of ``pipeline`` (one element per record): its pool of permits,
    our end of its link, a function that receives its next message (kind, body, and a
    record's elements), and the producer (which takes the broker's answers); stopped and
    closed on exit."""
    context = zmq.Context()
    link = context.socket(zmq.PAIR)
    link.setsockopt(zmq.LINGER, 0)
    link.bind("inproc://producer-test")
    # one element per record (a balanced job's), no origins, errors raised
    spec = ProducerSpec(plan=plan(pipeline), options=JobOptions(sharding=sharding, balanced=1),
                        index=0, width=1, entropy=1)
    pool = Pool()
    producer = Producer(context, "inproc://producer-test", spec, 0, pool, threading.Event(),
                        **options)
    producer.link = link  # as Links.start sets it: answers wake the producer through it
    producer.start()

    def receive() -> tuple[LinkKind, Any, list[int] | None]:
        assert link.poll(10_000), "the producer sent nothing for 10 s"
        kind = LinkKind(link.recv())
        sent, body = producer.outbox.popleft()  # (the frame only wakes the socket thread)
        assert sent is kind
        elements = None
        if kind is LinkKind.RECORD:
            elements = [int(v) for v in decode(body.buffers)]
            body = body.head
        return kind, body, elements

    try:
        yield pool, link, receive, producer
    finally:
        producer.stop.set()
        producer.join(10)
        link.close(0)
        context.term()


def test_producer_sends_one_record_per_permit_then_ends_the_epoch():
    with producer_link(Pipeline.range(5), "off") as (pool, link, receive, _):
        assert not link.poll(200)  # no permit, no record
        got: list[int] = []
        for _ in range(5):
            pool.release()
            kind, head, elements = receive()
            assert kind is LinkKind.RECORD and head.epoch == 0 and head.count == 1
            got.extend(elements or ())
        kind, end, _ = receive()  # (an end takes no permit)
        assert kind is LinkKind.END and end.epoch == 0
        assert got == list(range(5))


def test_a_stopped_producer_spends_no_credit_released_after_its_stop():
    """A new epoch stops the producer of the last one and then grants the new one's
    credits into the same pool: the stopped producer, waiting for a permit, must leave
    them (it took one and sent a record with it, and the next producer waited for good
    for a credit the consumer believed it held)."""
    context = zmq.Context()
    link = context.socket(zmq.PAIR)
    link.setsockopt(zmq.LINGER, 0)
    link.bind("inproc://producer-stop-test")
    spec = ProducerSpec(plan=plan(Pipeline.range(100)), options=JobOptions(sharding="off"),
                        index=0, width=1, entropy=1)
    pool = Pool()
    producer = Producer(context, "inproc://producer-stop-test", spec, 0, pool,
                        threading.Event())
    producer.start()
    try:
        deadline = time.monotonic() + 10
        while producer.stage != "blocked":  # waiting for a permit (a credit)
            assert time.monotonic() < deadline, "the producer never waited for a permit"
            time.sleep(0.01)
        producer.stop.set()  # as Task.abandon_stale: stop, wait out a send, then credit
        with producer.sending:
            pass
        pool.release(8)
        producer.join(10)
        assert not producer.is_alive()
        assert sum(pool.acquire(blocking=False) for _ in range(9)) == 8
        while link.poll(0):
            kind, _ = link.recv_multipart()
            assert LinkKind(kind) is not LinkKind.RECORD
    finally:
        producer.stop.set()
        producer.join(10)
        link.close(0)
        context.term()


def test_producer_asks_for_splits_and_records_them_for_a_replay():
    splits: dict = {}
    with producer_link(Pipeline.range(6, split_size=2), "dynamic", splits=splits) as (
            pool, _, receive, producer):
        for _ in range(10):
            pool.release()
        got: list[int] = []
        answers, asked = [2, 0, None], []
        while True:
            kind, body, elements = receive()
            if kind is LinkKind.SPLIT_REQ:  # answered as the broker does, one per place
                assert body["pass"] == [0] and body["have"] == len(asked)
                for at in range(1 + body["ahead"]):
                    asked.append(answers[len(asked)])
                    producer.answer(SplitAnswer((0,), asked[-1], body["have"] + at))
                    if asked[-1] is None:
                        break
            elif kind is LinkKind.RECORD:
                got.extend(elements or ())
            else:
                assert kind is LinkKind.PASS_DONE and body == [0]
                break
        assert receive()[0] is LinkKind.END
    assert asked == [2, 0, None] and got == [4, 5, 0, 1]
    assert splits == {(0,): [2, 0]}  # what a replay reads again, in order


def test_producer_asks_for_splits_ahead_after_quick_ones():
    """Short splits do not each wait for a round trip through the broker. The first split
    of a pass (how long it takes is not known yet) is asked for alone and read before the
    next is asked for; after a quick one the producer asks for many at once (``ahead``: as
    many as it reads in SPLIT_AHEAD_WORK at that pace), and asks again as soon as the last
    of those arrives, before it reads it."""
    with producer_link(Pipeline.range(2000, split_size=2), "dynamic", splits={}) as (
            pool, _, receive, producer):
        pool.release(1000)
        got: list[int] = []

        def until_request() -> tuple[int, int]:
            while True:
                kind, body, elements = receive()
                if kind is LinkKind.SPLIT_REQ:
                    return body["have"], body["ahead"]
                assert kind is LinkKind.RECORD
                got.extend(elements or ())

        assert until_request() == (0, 0)
        producer.answer(SplitAnswer((0,), 0, 0))
        have, ahead = until_request()
        assert have == 1 and 1 <= ahead < MAX_AHEAD and got == [0, 1]
        for at in range(1 + ahead):  # splits 1 .. 1 + ahead
            producer.answer(SplitAnswer((0,), 1 + at, 1 + at))
        last = 1 + ahead
        assert until_request()[0] == last + 1
        assert 2 * last not in got  # asked before the last split's first element
        producer.answer(SplitAnswer((0,), None, last + 1))
        while True:
            kind, _, elements = receive()
            assert kind is not LinkKind.SPLIT_REQ
            if kind is LinkKind.RECORD:
                got.extend(elements or ())
            elif kind is LinkKind.END:
                break
        assert got == list(range(2 * (last + 1)))


def test_a_producer_waiting_for_a_permit_leaves_when_it_is_stopped_not_at_its_timeout():
    """A stopped producer (its Loader closing) must not sit out its wait for a credit."""
    pool, stop = Pool(), threading.Event()
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=60, stop=stop)))
    waiter.start()
    assert not pool.acquire(blocking=False)
    stop.set()
    pool.wake()
    waiter.join(10)  # (does not hang: the wait's timeout is 60 s)
    assert not waiter.is_alive() and got == [False]
    assert not pool.acquire(timeout=60, stop=stop)  # stopped: no wait at all
    pool.release(2)
    assert pool.acquire(stop=stop) and pool.acquire(blocking=False)  # permits still count
    assert not pool.acquire(blocking=False)


def test_a_reconnected_worker_asks_again_for_every_pass_it_waits_on():
    """A worker-drawn mix reads a pass of each input at once, each with its split request
    out. A broker restarted after answering one of them in part (its null lost with the
    old broker) must be asked again for both (one was forgotten: its producer waited for
    a null that never came until the broker dropped the worker as stuck, 30 s)."""
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    hello = Ready(worker="w1", host="h", host_id="h/boot/ns", pid=1,
                  endpoint="tcp://127.0.0.1:1")
    link = BrokerLink(context, f"tcp://127.0.0.1:{port}", None, hello)
    try:
        def received() -> SplitReq | Ready:
            assert router.poll(5000), "nothing reached the broker"
            record = messages.decode(decode_message(router.recv_multipart()[1:]))
            assert isinstance(record, (SplitReq, Ready))
            return record

        assert isinstance(received(), Ready)
        a, b = (0, 1 << 40), (0, (1 << 40) + 1)
        link.ask(SplitReq(task="t", pass_=b, have=1, ahead=20))
        link.answered_split(Split(task="t", pass_=b, split=11, have=1, then=(12, 13)))
        link.ask(SplitReq(task="t", pass_=a, have=1, ahead=0))
        link.answered_split(Split(task="t", pass_=b, split=11, have=1))  # (an old answer)
        assert [received(), received()] == [SplitReq(task="t", pass_=b, have=1, ahead=20),
                                            SplitReq(task="t", pass_=a, have=1, ahead=0)]
        link.ask_again("t")
        again = {tuple(r.pass_): r for r in (received(), received())}
        assert again == {b: SplitReq(task="t", pass_=b, have=4, ahead=17),
                         a: SplitReq(task="t", pass_=a, have=1, ahead=0)}
        link.answered_split(Split(task="t", pass_=a, split=None, have=1))
        link.answered_split(Split(task="t", pass_=b, split=None, have=4))
        link.ask_again("t")  # (nothing left to ask)
        assert not router.poll(200)
    finally:
        link.close()
        router.close(0)
