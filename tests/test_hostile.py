"""Hostile input: random, truncated, oversized and out-of-order messages sent to a live
broker and a live worker's data port never crash them or stop them serving, and each is
counted. (Seeded: ``make test`` runs the same examples every time.)"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.service import dealers, service, status, wait_for
from zloader import Loader, Pipeline
from zloader.transport.protocol import VERSION, Command, ProtocolError, decode
from zloader.transport.ring import RingError, RingReader, RingWriter
from zloader.transport.shm import Segment

FIELDS = ["worker", "task", "job", "consumer", "epoch", "pass", "split", "credits", "ring",
          "mapped", "rounds", "round", "members", "consumer_index", "fingerprint",
          "job_name", "sharding", "source", "share", "coordinated", "stats", "count",
          "segment", "heartbeat", "endpoint", "pid", "host_id", "num_workers", "rerun"]
values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELDS),
                                                                  inner, max_size=4),
    max_leaves=12)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8).map(
    lambda d: json.dumps(d).encode()) | st.one_of(  # hostile JSON: deep nesting, huge ints
    st.integers(1, 200_000).map(lambda n: b"[" * n),
    st.integers(1, 20_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.integers(1, 6_000).map(lambda n: b'{"epoch":' + b"9" * n + b"}"))
commands = st.sampled_from([bytes((c,)) for c in Command]) | st.binary(min_size=0, max_size=3)
frames = st.lists(st.binary(max_size=64), max_size=3)
messages = st.one_of(
    st.tuples(st.just(VERSION), commands, bodies, frames).map(lambda t: [t[0], t[1], t[2],
                                                                         *t[3]]),
    st.tuples(st.just(VERSION), commands, st.binary(max_size=40)).map(list),  # not JSON
    st.lists(st.binary(max_size=32), min_size=1, max_size=4),  # anything
)


@given(st.lists(messages, min_size=1, max_size=6))
@settings(max_examples=300, derandomize=True, deadline=None)
def test_the_decoder_raises_only_protocol_error(batch):
    for frames_ in batch:
        with contextlib.suppress(ProtocolError):  # anything else fails the test
            decode(frames_)


LIVE = {"derandomize": True, "deadline": None, "phases": [Phase.generate],
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


@given(st.lists(messages, min_size=60, max_size=60))
@settings(max_examples=1, **LIVE)
def test_random_messages_never_stop_the_broker_or_a_worker(batch):
    hostile_round(batch)


@pytest.mark.slow
@given(st.lists(messages, min_size=200, max_size=200))
@settings(max_examples=10, **LIVE)
def test_many_random_messages_never_stop_the_broker_or_a_worker(batch):
    hostile_round(batch)


def hostile_round(batch: list) -> None:
    """Send ``batch`` to a live broker and worker while a Loader reads; both must keep
    serving, and count what they dropped."""
    with service(1) as (address, procs):
        with Loader(Pipeline.range(10**6), broker=address, timeout=20) as loader:
            epoch = iter(loader)
            next(epoch)  # a consumer is reading: the worker has a task and streams
            (worker,) = status(address)["workers"]
            with dealers(address, worker["endpoint"]) as socks:
                for message in batch:
                    for sock in socks:
                        sock.send_multipart(message)
                for _ in range(2000):  # the reader keeps reading meanwhile
                    next(epoch)
                (pid,) = [p.pid for p in procs]
                wait_for(lambda: status(address)["rejected"] > 0 and any(
                    w["pid"] == pid and w.get("rejected", 0) > 0
                    for w in status(address)["workers"]),
                    what="the broker's and the worker's counts of rejected messages")
                for _ in range(2000):
                    next(epoch)
        assert all(p.poll() is None for p in procs), "a worker died"
        with Loader(Pipeline.range(100), broker=address, timeout=20) as again:
            assert sorted(again) == list(range(100))


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
       st.lists(st.tuples(st.integers(-10, 2**20), st.integers(-10, 2**20)), max_size=4))
@settings(max_examples=200, derandomize=True, deadline=None)
def test_corrupt_ring_headers_raise_ring_errors_never_worse(capacity, tail, head, claims):
    """A peer that overwrites a ring's header words (or sends impossible positions) gets
    RingError on either side, never a crash or a view outside the segment."""
    with RingReader(64 * 1024) as reader:
        writer = RingWriter(reader.name)
        try:
            assert writer.reserve(100) is not None
            words = reader._segment.buf[:64].cast("Q")
            words[2], words[3] = tail, head  # what the writer and the reader trust
            with contextlib.suppress(RingError):
                writer.reserve(100)
            for position, length in claims:
                try:
                    array = reader.claim(position, length)
                except RingError:
                    continue
                assert len(array) == length and length <= reader.capacity
            words[1] = capacity
            words.release()
            try:
                RingWriter(reader.name).close()  # a second writer checks the capacity
            except RingError:
                assert capacity < 64 or capacity % 64 or capacity > reader.capacity
        finally:
            writer.close()


def test_a_live_ring_overwritten_by_another_process_is_survived_and_counted():
    """Garbage written over a reading Loader's rings (data and headers) while it reads:
    its worker and its consumer keep going; corrupt records are dropped and counted."""
    pipeline = Pipeline.range(10**7).map(lambda i: np.full(256, i % 251, np.uint8))
    with Loader(pipeline, num_workers=1, timeout=20) as loader:
        epoch = iter(loader)
        next(epoch)
        (peer,) = loader._io.peers()
        target = Segment.attach(peer.ring.name)
        rng = np.random.default_rng(0)
        try:
            view = np.frombuffer(target.buf, np.uint8)
            for _ in range(200):
                start = int(rng.integers(0, len(view) - 4096))
                view[start:start + 4096] = rng.integers(0, 256, 4096, np.uint8)
                view[16:32] = rng.integers(0, 256, 16, np.uint8)  # tail and head words
                for _ in range(20):
                    next(epoch)  # values may be garbage; the loop must go on
            del view
        finally:
            target.close()
        assert loader._processes[0].poll() is None, "the worker died"
    # and the next Loader works (the sweep runs; no segment is left: the no_leaks fixture)
    with Loader(Pipeline.range(50), num_workers=1, timeout=20) as again:
        assert sorted(again) == list(range(50))


@pytest.mark.slow
def test_a_flood_of_bad_messages_does_not_grow_the_brokers_or_a_workers_memory():
    """40,000 malformed messages (random frames, bodies of up to the size limit, unknown
    peers' commands) to the broker and a worker: their resident memory grows by less than
    32 MiB, and both still serve."""
    import psutil

    rng = np.random.default_rng(0)
    junk = [[VERSION, bytes((int(rng.integers(0, 60)),)),
             json.dumps({"task": "x" * int(rng.integers(0, 50_000))}).encode()],
            [VERSION, bytes((Command.SPLIT_REQ,)), b"{}"],
            [b"\xff" * 10], [VERSION, bytes((Command.REGISTER,)), b"not json"]]
    with service(1) as (address, procs):
        (worker,) = status(address)["workers"]
        watched = [psutil.Process(p.pid) for p in procs]
        broker_pid = next(c.pid for c in psutil.Process().children()
                          if "zloader-broker" in " ".join(c.cmdline()))
        watched.append(psutil.Process(broker_pid))
        with dealers(address, worker["endpoint"]) as socks:
            before = [p.memory_info().rss for p in watched]
            for i in range(10_000):
                for sock in socks:
                    sock.send_multipart(junk[i % len(junk)])
            wait_for(lambda: status(address)["rejected"] >= 5_000,
                     what="the broker to work through the flood", timeout=120)
            after = [p.memory_info().rss for p in watched]
        growth = [(a - b) / 2**20 for a, b in zip(after, before, strict=True)]
        assert max(growth) < 32, f"memory grew by {growth} MiB"
        with Loader(Pipeline.range(100), broker=address, timeout=20) as loader:
            assert sorted(loader) == list(range(100))



DEEP = b"[" * 100_000  # a JSON body nested deeper than any parser's recursion limit


def test_nested_json_does_not_kill_the_broker_or_a_loaders_source_socket():
    """One unauthenticated message of 100,000 nested brackets, sent to the broker and as a
    FETCH to a Loader's source-data socket, is dropped and counted: both keep serving. So
    is a body holding an integer wider than any field (4,000 digits)."""
    source = np.arange(300_000, dtype=np.int64)  # 2.4 MB: served from the Loader's socket
    with service(1) as (address, _procs):
        with Loader(Pipeline.from_arrays(source), broker=address, timeout=20) as loader:
            epoch = iter(loader)
            next(epoch)
            endpoint = loader._io.registration["source_data"]["endpoint"]
            with dealers(address, endpoint) as (broker, fetch):
                broker.send_multipart([VERSION, bytes((Command.REGISTER,)), DEEP])
                broker.send_multipart([VERSION, bytes((Command.STATUS,)),
                                       b'{"epoch":' + b"9" * 4_000 + b"}"])
                fetch.send_multipart([VERSION, bytes((Command.FETCH,)), DEEP])
                fetch.send_multipart([VERSION, bytes((Command.FETCH,)), b"{}"])
                assert fetch.poll(10_000), "the source socket stopped answering"
                assert decode(fetch.recv_multipart()).command is Command.SOURCE
                wait_for(lambda: (status(address) or {}).get("rejected", 0) == 2,
                         what="the broker to count both messages")
                assert not broker.poll(0), "the broker answered a STATUS it should drop"
            for _ in range(1000):
                next(epoch)
            assert loader.stats()["rejected"] == 1
