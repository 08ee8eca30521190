"""Record notices (zloader/transport/notice.py): co-located workers announce ring records on
the consumer's pipe instead of sending a DATA message each. What goes through the pipe is
checked like any input; a notice that cannot be written goes as a DATA message naming the
framed record; the pipe is a /dev/shm entry that nothing leaves behind."""

from __future__ import annotations

import os
import struct

import numpy as np
import zmq

from zloader import Loader, Pipeline
from zloader.client.receive import unframe as _unframe
from zloader.transport import messages
from zloader.transport.notice import NOTICE, Notices, open_notify
from zloader.transport.protocol import decode
from zloader.transport.ring import RingReader
from zloader.transport.shm import SHM_DIR, segment_name
from zloader.worker.outgoing import Head
from zloader.worker.streams import Outlet, Stream


def test_notices_are_read_whole_and_all_at_once():
    notices = Notices()
    try:
        writer = open_notify(notices.name)
        assert writer is not None
        for i in range(100):
            os.write(writer, NOTICE.pack(i, 64 * i, 4096 * i))
        assert list(notices.read()) == [(i, 64 * i, 4096 * i) for i in range(100)]
        assert list(notices.read()) == []  # nothing waits: nothing, at once
        os.close(writer)
    finally:
        notices.close()
    assert not os.path.exists(os.path.join(SHM_DIR, notices.name))
    notices.close()  # twice is safe


def test_a_worker_writes_notices_only_to_a_zloader_pipe_of_its_own_user(tmp_path):
    assert open_notify("../etc/passwd") is None
    assert open_notify("not-a-segment") is None
    name = segment_name("notify")
    assert open_notify(name) is None  # no such pipe
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:  # a regular file under a pipe's name is never written
        f.write(b"keep")
    try:
        assert open_notify(name) is None
        with open(path, "rb") as f:
            assert f.read() == b"keep"
    finally:
        os.unlink(path)
    os.symlink(tmp_path, path)  # nor does a link lead it elsewhere
    try:
        assert open_notify(name) is None
    finally:
        os.unlink(path)


def _tagged(i: int) -> np.ndarray:
    return np.full(8, i, np.int64)


def test_junk_on_a_live_loaders_notice_pipe_is_dropped_and_counted():
    """Notices another process writes into a reading Loader's pipe (unknown ring ids,
    impossible positions, the ring of a real worker at random places, notices cut short
    that put the rest of what was read with them out of step): dropped and counted. The
    records whose notices they spoiled are lost as a corrupt message's are, and read
    again by exactly-once: the epoch holds every element once."""
    n = 3000
    with Loader(Pipeline.range(n).map(_tagged), num_workers=2, timeout=30) as loader:
        epoch = iter(loader)
        got = [int(next(epoch)[0])]
        pipe = loader._io.loop._peers.notices
        assert pipe is not None
        writer = open_notify(pipe.name)
        assert writer is not None
        rng = np.random.default_rng(0)
        try:
            for _ in range(300):
                ring_id = int(rng.choice([0, 1, 2, 3, 999, 2**32 - 1]))
                os.write(writer, NOTICE.pack(ring_id, int(rng.integers(0, 2**32)),
                                             int(rng.integers(0, 2**63))))
                os.write(writer, b"\x07" * 5)  # and notices cut short
                got.append(int(next(epoch)[0]))
        finally:
            os.close(writer)
        got += [int(a[0]) for a in epoch]
        rejected = loader.stats()["rejected"]
    assert rejected > 0
    assert sorted(got) == list(range(n))


def test_a_notice_that_cannot_be_written_goes_as_a_data_message():
    """The consumer's pipe is full (it stopped reading): the record is in the ring,
    framed, and a DATA message names it; the consumer reads it from there."""
    context = zmq.Context()
    ring = RingReader(1 << 20)
    notices = Notices()
    router = context.socket(zmq.ROUTER)
    dealer = context.socket(zmq.DEALER)
    fd = None
    try:
        router.bind("inproc://outlet")
        dealer.connect("inproc://outlet")
        dealer.send(b"hello")
        identity, _ = router.recv_multipart()
        fd = open_notify(notices.name)
        assert fd is not None
        while True:  # fill the pipe
            try:
                os.write(fd, NOTICE.pack(0, 0, 0))
            except BlockingIOError:
                break
        stream = Stream(identity, "consumer", 0)
        stream.attach(ring.name, 7, notices.name)
        outlet = Outlet(router, lambda text, exc_info=False: None)
        frames = [np.arange(10, dtype=np.int64).tobytes()]
        outlet.record(stream, Head(0, 1), frames)
        msg = decode(dealer.recv_multipart(copy=False))
        data = messages.decode(msg)
        assert isinstance(data, messages.Data) and data.framed and data.ring is not None
        position, length, name = data.ring
        assert name == ring.name
        body, buffers = _unframe(ring.claim(position, length))
        assert body.count == 1 and body.epoch == 0 and not body.framed
        assert bytes(buffers[0]) == frames[0]
        stream.close()
        assert stream.notify is None
    finally:
        if fd is not None:
            os.close(fd)
        notices.close()
        ring.close()
        router.close(0)
        dealer.close(0)
        context.term()


def test_a_framed_record_says_how_many_of_its_epochs_records_went_as_messages_before_it():
    """A worker's record that goes as a DATA message (a full ring, a segment) is counted,
    and the next framed records of that epoch say so (``after``); none does before the
    first such message, nor in the next epoch until one goes there too."""
    context = zmq.Context()
    ring = RingReader(1 << 20)
    notices = Notices()
    router = context.socket(zmq.ROUTER)
    dealer = context.socket(zmq.DEALER)
    try:
        router.bind("inproc://outlet-after")
        dealer.connect("inproc://outlet-after")
        dealer.send(b"hello")
        identity, _ = router.recv_multipart()
        stream = Stream(identity, "consumer", 0)
        stream.attach(ring.name, 7, notices.name)
        outlet = Outlet(router, lambda text, exc_info=False: None)
        frames = [np.arange(10, dtype=np.int64).tobytes()]

        def framed(epoch):
            outlet.record(stream, Head(epoch, 1), frames)
            [(ring_id, length, position)] = list(notices.read())
            assert ring_id == 7
            return _unframe(ring.claim(position, length))[0]

        assert framed(0).after is None
        for sent in (1, 2):  # records that went as messages (here: sent as such)
            outlet.send(stream, messages.Data(epoch=0, count=1, ring=None), frames)
            messages.decode(decode(dealer.recv_multipart(copy=False)))
            assert framed(0).after == sent
        outlet.send(stream, messages.End(epoch=0))  # (not a record: not counted)
        dealer.recv_multipart()
        assert framed(0).after == 2
        assert framed(1).after is None
        stream.close()
    finally:
        notices.close()
        ring.close()
        router.close(0)
        dealer.close(0)
        context.term()


def test_a_framed_record_whose_body_names_a_place_is_refused():
    import pytest

    from zloader.transport.protocol import ProtocolError

    body = messages.Data.checked({
        "epoch": 0, "count": 1, "skipped": 0, "ring": (0, 64, "zloader-x"), "segment": None,
        "full": False, "shared": False, "lagged": None, "round": None, "origins": False,
        "framed": False}).to_body()
    block = np.zeros(256, np.uint8)
    struct.pack_into("<II", block, 0, len(body), 0)
    block[8:8 + len(body)] = np.frombuffer(body, np.uint8)
    with pytest.raises(ProtocolError, match="place of its own"):
        _unframe(block)
    struct.pack_into("<II", block, 0, 10_000, 0)
    with pytest.raises(ProtocolError, match="body of 10000"):
        _unframe(block)


def _hold_the_loop(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` without letting the Loader's I/O thread run
    (it waits for the interpreter): what workers send meanwhile piles up."""
    import sys
    import time

    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(old)


def _slow_row(i: int) -> np.ndarray:
    import time

    time.sleep(0.0012)  # each element alone in its record
    return np.full(4, i, np.int64)


def test_records_after_one_whose_notice_found_the_pipe_full_keep_their_order():
    """The consumer's pipe is small (a page, what Linux gives a user over its pipe quota)
    and the consumer is held off its loop: a notice finds the pipe full, its record goes
    as a DATA message, and the worker's next records must not overtake it through the
    pipe once it has room (they did: the ring refused the overtaken record as out of
    order, and its elements were lost without exactly-once)."""
    import fcntl

    n = 1500
    with Loader(Pipeline.range(n, split_size=n).map(_slow_row), num_workers=1, timeout=60,
                prefetch=1024, exactly_once=False) as loader:
        it = iter(loader)
        got = [int(next(it)[0])]
        pipe = loader._io.loop._peers.notices
        fd = open_notify(pipe.name)
        assert fd is not None
        assert fcntl.fcntl(fd, 1031, 4096) == 4096  # F_SETPIPE_SZ: 256 notices
        os.close(fd)
        _hold_the_loop(1.5)
        got += [int(a[0]) for a in it]
        stats = loader.stats()
    assert got == list(range(n)), (stats["rejected"], n - len(set(got)))
    assert stats["rejected"] == 0


def _padded(i: int) -> dict:
    import time

    time.sleep(0.0002)  # (the consumer frees a slot meanwhile: the next record fits)
    return {"i": i, "pad": np.zeros(16 * 1024, np.uint8)}


def test_records_after_one_that_found_the_ring_full_keep_their_order():
    """A user who keeps the last elements fills a small ring: a record then goes with its
    payload over the socket, and the next ones (the ring has room again) must not overtake
    it through the pipe: one worker's elements come in the order it made them."""
    import collections

    n, hold = 6000, 2000
    with Loader(Pipeline.range(n, split_size=n).map(_padded), num_workers=1, timeout=60,
                ring_bytes=1 << 20, prefetch=8) as loader:
        held: collections.deque = collections.deque(maxlen=hold)
        got = []
        for x in loader:
            got.append(int(x["i"]))
            held.append(x)  # the ring fills with what the user keeps
        stats = loader.stats()
        held.clear()
    assert stats["private"] + stats["segments"] > 0  # (the ring did fill)
    assert got == list(range(n))


def _every_other_large(i: int) -> dict:
    import time

    time.sleep(0.002)  # (each element alone in its record)
    return {"i": i, "pad": np.zeros((5 << 20) if i % 2 == 0 else 16, np.uint8)}


def test_a_notice_read_before_an_earlier_records_message_waits_for_it():
    """Records too large for the ring go as DATA messages (naming a segment) and the small
    ones between them through the ring with a notice. While the consumer's loop is held
    up, both pile up; it reads the pipe first, so the notices of the small records come
    before the messages of the large ones made earlier: it holds those records back (each
    says how many messages came before it) and yields the worker's records in order."""
    n = 200
    with Loader(Pipeline.range(n, split_size=n).map(_every_other_large), num_workers=1,
                timeout=60, ring_bytes=4 << 20, prefetch=16, exactly_once=False) as loader:
        it = iter(loader)
        got = [int(next(it)["i"])]
        _hold_the_loop(1.0)
        got += [int(x["i"]) for x in it]
        stats = loader.stats()
    assert stats["segments"] == n // 2 and stats["held"] > 0  # (the notices came first)
    assert got == list(range(n))
    assert stats["rejected"] == 0
