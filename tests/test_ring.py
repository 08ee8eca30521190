"""The shared-memory segments and the SPSC ring, on real /dev/shm memory and, where stated,
with a real second process."""

from __future__ import annotations

import gc
import os
import queue
import random
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zloader._defaults import RING_RESERVE_BYTES
from zloader.errors import ZloaderError
from zloader.transport import shm
from zloader.transport.ring import (
    ALIGN,
    COUNT_MASK,
    DATA_OFFSET,
    DEFAULT_RING_BYTES,
    RingError,
    RingReader,
    RingWriter,
    credits_since,
    credits_word,
    open_of,
)
from zloader.transport.shm import PREFIX, Segment, ShmError, segment_name, sweep

WAIT_S = 60  # bound on every wait for a child process


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _pattern(seed: int, length: int) -> bytes:
    return bytes((seed * 7 + k) % 251 for k in range(length))


def _check_intact(records: Iterable[tuple[np.ndarray, bytes]]) -> None:
    """Assert that each claimed array still holds the bytes written into it.

    A helper rather than a loop in the test, so no loop variable keeps a record alive.
    """
    for array, expected in records:
        assert bytes(array) == expected


def _mapped(name: str) -> bool:
    """Whether this process still has the segment ``name`` mapped."""
    with open("/proc/self/maps") as maps:
        return any(name in line for line in maps)


@pytest.fixture
def ring() -> Iterator[tuple[RingReader, RingWriter]]:
    reader = RingReader(4096)
    writer = RingWriter(reader.name)
    try:
        yield reader, writer
    finally:
        writer.close()
        reader.close()


def _put(writer: RingWriter, data: bytes) -> int | None:
    got = writer.reserve(len(data))
    if got is None:
        return None
    position, view = got
    view[:] = data
    return position


# --- segments -------------------------------------------------------------------------


def test_segment_name_format_and_kind_validation() -> None:
    name = segment_name("ring")
    assert name.startswith(f"{PREFIX}{os.getuid()}-{os.getpid()}-ring-")
    assert len(name.rsplit("-", 1)[1]) == 8
    assert segment_name("ring") != name
    for bad in ("", "Ring", "a-b", "a/b", "x" * 17, 3):
        with pytest.raises(ValueError):
            segment_name(bad)  # type: ignore[arg-type]


def test_segment_create_attach_share_memory_and_cleanup() -> None:
    with Segment.create("test", 10000) as seg:
        assert seg.owner and seg.size == 10000
        assert os.path.exists(f"/dev/shm/{seg.name}")
        assert os.stat(f"/dev/shm/{seg.name}").st_mode & 0o777 == 0o600
        assert bytes(seg.buf[:16]) == bytes(16)
        other = Segment.attach(seg.name)
        try:
            other.buf[9999] = 42
            assert seg.buf[9999] == 42
            with pytest.raises(PermissionError):
                other.unlink()
        finally:
            other.close()
            other.close()  # idempotent
        assert other.closed
        with pytest.raises(ValueError):
            other.buf
    assert not os.path.exists(f"/dev/shm/{seg.name}")
    assert not _mapped(seg.name)
    seg.unlink()  # idempotent once gone
    seg.close()


@pytest.mark.parametrize("name", ["../etc/passwd", "zloader-x", "zloader-1-2-ring-abc/defg0",
                                  "other-1-2-ring-0123abcd", f"{PREFIX}1-2-RING-0123abcd"])
def test_segment_attach_refuses_foreign_names(name: str) -> None:
    with pytest.raises(ValueError):
        Segment.attach(name)


def test_segment_attach_missing() -> None:
    with pytest.raises(FileNotFoundError):
        Segment.attach(segment_name("gone"))


def test_segment_close_with_live_views_defers_unmap() -> None:
    seg = Segment.create("test", 8192)
    seg.buf[100:104] = b"abcd"
    view = seg.buf[100:104]
    array = np.frombuffer(seg.buf, dtype=np.uint8, count=4, offset=100)
    seg.close()  # must not raise BufferError
    seg.unlink()
    assert bytes(view) == b"abcd" and bytes(array) == b"abcd"
    assert _mapped(seg.name)  # still mapped: the views keep it
    del view, array
    gc.collect()
    assert not _mapped(seg.name)


def test_create_larger_than_free_space_raises_shm_error() -> None:
    info = os.statvfs("/dev/shm")
    if info.f_blocks == 0:
        pytest.skip("/dev/shm reports no size limit")
    total = info.f_blocks * info.f_frsize
    free = info.f_bavail * info.f_frsize
    capacity = _round_up(max(total, free) + (1 << 30))
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(ShmError) as caught:
        RingReader(capacity)
    message = str(caught.value)
    assert "ring_bytes" in message and "/dev/shm" in message and "MiB free" in message
    assert isinstance(caught.value, OSError) and isinstance(caught.value, ZloaderError)
    assert set(os.listdir("/dev/shm")) <= before


def test_fallocate_failure_unlinks_the_half_made_file(monkeypatch: pytest.MonkeyPatch) -> None:
    # Skip the up-front free-space check so that posix_fallocate itself runs out of room.
    info = os.statvfs("/dev/shm")
    if info.f_blocks == 0:
        pytest.skip("/dev/shm reports no size limit")
    monkeypatch.setattr(shm, "_check_free", lambda size: None)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(ShmError, match="ring_bytes"):
        Segment.create("test", info.f_blocks * info.f_frsize + (1 << 30))
    assert set(os.listdir("/dev/shm")) <= before


def test_the_writer_reserves_the_data_as_its_records_reach_into_it() -> None:
    """A ring costs its reader no time zeroing the data (a sparse file); its writer
    allocates RING_RESERVE_BYTES when it attaches, before it can write a byte, and more,
    doubling, only as records reach past that: a ring takes the memory its records use."""
    reader = RingReader(64 << 20)
    try:
        path = f"/dev/shm/{reader.name}"
        assert os.stat(path).st_blocks * 512 < 1 << 20
        writer = RingWriter(reader.name)
        allocated = os.stat(path).st_blocks * 512
        assert RING_RESERVE_BYTES <= allocated < RING_RESERVE_BYTES + (1 << 20)
        assert writer.reserved == RING_RESERVE_BYTES
        for _ in range(64):  # small records, released as they come: the first MiBs only
            position, view = writer.reserve(4096)  # type: ignore[misc]
            view[:] = b"x" * 4096
            reader.claim(position, 4096)
        assert writer.reserved == RING_RESERVE_BYTES
        position, view = writer.reserve(5 << 20)  # type: ignore[misc]
        assert writer.reserved >= position % (64 << 20) + (5 << 20)
        assert writer.reserved < 16 << 20  # doubled as needed, not the capacity
        assert os.stat(path).st_blocks * 512 >= writer.reserved
        writer.close()
    finally:
        reader.close()


def test_a_record_that_dev_shm_has_no_room_for_goes_another_way(
        monkeypatch: pytest.MonkeyPatch) -> None:
    info = os.statvfs("/dev/shm")
    if info.f_blocks == 0:
        pytest.skip("/dev/shm reports no size limit")
    monkeypatch.setattr(shm, "_check_free", lambda size: None)  # the reader's check passes
    too_large = _round_up(info.f_blocks * info.f_frsize + (1 << 30))
    reader = RingReader(too_large + RING_RESERVE_BYTES)
    try:
        with RingWriter(reader.name) as writer:  # reserves its first MiBs only
            assert writer.reserve(too_large) is None  # no SIGBUS: the caller sends it
            _, view = writer.reserve(100)  # type: ignore[misc]
            assert len(view) == 100
            assert writer.reserved < 1 << 30
    finally:
        reader.close()


def test_sweep_removes_dead_owners_only() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=WAIT_S)
    dead = child.pid
    try:
        os.kill(dead, 0)
        pytest.skip("the exited child's pid was reused already")
    except ProcessLookupError:
        pass
    uid = os.getuid()
    dead_name = f"{PREFIX}{uid}-{dead}-test-{secrets.token_hex(4)}"
    foreign_name = f"{PREFIX}{uid + 1}-{dead}-test-{secrets.token_hex(4)}"
    for name in (dead_name, foreign_name):
        os.close(os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    live = Segment.create("test", 4096)
    try:
        removed = sweep()
        assert dead_name in removed
        assert live.name not in removed and foreign_name not in removed
        assert not os.path.exists(f"/dev/shm/{dead_name}")
        assert os.path.exists(f"/dev/shm/{live.name}")
        assert os.path.exists(f"/dev/shm/{foreign_name}")
    finally:
        live.close()
        live.unlink()
        for name in (dead_name, foreign_name):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


# --- ring -----------------------------------------------------------------------------


def test_round_trip_zero_copy(ring: tuple[RingReader, RingWriter]) -> None:
    reader, writer = ring
    assert reader.capacity == writer.capacity == 4096
    got = writer.reserve(100)
    assert got is not None
    position, view = got
    assert position == 0 and len(view) == 100 and not view.readonly
    view[:] = _pattern(1, 100)
    array = reader.claim(position, 100)
    assert array.dtype == np.uint8 and array.shape == (100,)
    assert bytes(array) == _pattern(1, 100)
    # Same memory, not a copy: a later write through the writer's view shows in the array.
    view[0] = 255
    assert array[0] == 255
    array[1] = 254
    assert view[1] == 254
    assert not array.flags.owndata
    assert reader.outstanding() == 1 and reader.tail == 0
    # Views derived from the array keep the record claimed.
    derived = np.frombuffer(memoryview(array)[10:20], dtype=np.uint8)
    del array
    assert reader.outstanding() == 1
    del derived
    assert reader.outstanding() == 0
    assert reader.tail == _round_up(100) == writer.head


def test_records_are_aligned(ring: tuple[RingReader, RingWriter]) -> None:
    reader, writer = ring
    arrays = []
    for length in (1, 63, 64, 65, 8):
        position = _put(writer, _pattern(length, length))
        assert position is not None and position % ALIGN == 0
        arrays.append(reader.claim(position, length))
    for array in arrays:
        assert array.ctypes.data % ALIGN == 0
    assert np.frombuffer(arrays[-1], dtype=np.float64).shape == (1,)


def test_wrap_around_many_random_records() -> None:
    rng = random.Random(1234)
    with RingReader(4096) as reader, RingWriter(reader.name) as writer:
        live: list[tuple[np.ndarray, bytes]] = []
        cursor = 0
        last_tail = 0
        wraps = 0
        for index in range(3000):
            length = rng.randint(1, 1200)
            data = _pattern(index, length)
            position = _put(writer, data)
            while position is None:
                assert live, "an empty ring refused a record that fits"
                live.pop(rng.randrange(len(live)))  # release in random order
                tail = reader.tail
                assert tail >= last_tail
                last_tail = tail
                position = _put(writer, data)
            assert position % ALIGN == 0 and position >= cursor
            if position != cursor:  # padding: only ever to the start of the region
                assert position % 4096 == 0 and position - cursor < 4096
                wraps += 1
            assert position % 4096 + length <= 4096
            cursor = position + _round_up(length)
            live.append((reader.claim(position, length), data))
            _check_intact(live)
        assert wraps > 50
        live.clear()
        assert reader.outstanding() == 0
        assert reader.tail == cursor == writer.head


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 700), st.integers(0, 1000)),
                max_size=120))
def test_ring_matches_a_model(ops: list[tuple[int, int, int]]) -> None:
    """Random reserve/claim and out-of-order releases against a plain-Python model."""
    capacity = 2048
    with RingReader(capacity) as reader, RingWriter(reader.name) as writer:
        live: dict[int, tuple[np.ndarray, bytes]] = {}  # position -> (array, data)
        model: list[list[int]] = []  # [position, end, released] in claim order
        head = tail = 0
        for step, (op, length, pick) in enumerate(ops):
            if op == 2 and live:  # release one live record, any of them
                victim = sorted(live)[pick % len(live)]
                del live[victim]
                next(entry for entry in model if entry[0] == victim)[2] = 1
                while model and model[0][2]:
                    tail = model.pop(0)[1]
                assert reader.tail == tail
                continue
            rounded = _round_up(length)
            start = head
            if start % capacity + rounded > capacity:
                start += capacity - start % capacity  # padding to the region start
            fits = start + rounded - tail <= capacity
            data = _pattern(step, length)
            position = _put(writer, data)
            assert (position is not None) == fits
            if position is None:
                continue
            assert position == start
            head = start + rounded
            model.append([position, head, 0])
            live[position] = (reader.claim(position, length), data)
            _check_intact(live.values())
        assert reader.outstanding() == len(live)
        live.clear()
        assert reader.outstanding() == 0 and reader.tail == head


def test_out_of_order_release(ring: tuple[RingReader, RingWriter]) -> None:
    reader, writer = ring
    arrays = []
    for index in range(4096 // ALIGN):
        position = _put(writer, _pattern(index, ALIGN))
        assert position == index * ALIGN
        arrays.append(reader.claim(position, ALIGN))
    assert writer.reserve(1) is None  # full
    first = arrays[0]
    arrays.clear()  # release records 1..63, keep 0
    assert reader.outstanding() == 1
    assert reader.tail == 0
    assert writer.reserve(1) is None  # still full: record 0 pins everything after it
    assert bytes(first) == _pattern(0, ALIGN)
    del first
    assert reader.outstanding() == 0 and reader.tail == 4096
    got = writer.reserve(1)
    assert got is not None and got[0] == 4096


def test_oversize_and_empty_records(ring: tuple[RingReader, RingWriter]) -> None:
    reader, writer = ring
    assert writer.reserve(4097) is None
    assert writer.reserve(0) is None
    with pytest.raises(ValueError):
        writer.reserve(-1)
    got = writer.reserve(4096)  # exactly the capacity fits an empty ring
    assert got is not None
    array = reader.claim(got[0], 4096)
    assert writer.reserve(1) is None
    del array
    assert writer.reserve(1) is not None


def test_padding_counts_as_used_space(ring: tuple[RingReader, RingWriter]) -> None:
    reader, writer = ring
    a = reader.claim(_put(writer, bytes(3000)), 3000)  # type: ignore[arg-type]
    del a  # tail 3008: 1088 free at the end, 3008 at the start
    position = _put(writer, bytes(2000))  # does not fit before the end: wraps
    assert position == 4096
    b = reader.claim(position, 2000)
    # 3008 + 1088 padding + 2048 -> 6144 used up to; free = 4096 - (6144 - 3008) = 960
    assert writer.reserve(961) is None
    assert writer.reserve(960) is not None
    del b


@pytest.mark.parametrize(("position", "length"), [
    (0, 0),            # empty
    (-64, 10),         # negative
    (32, 10),          # not aligned
    (4096, 10),        # not reserved yet
    (0, 5000),         # longer than the ring
    (4032, 128),       # runs past the region end
    (2**64, 1),        # beyond the position space
    ("0", 10),         # not an int
])
def test_bad_positions_from_peer(ring: tuple[RingReader, RingWriter], position: object,
                                 length: int) -> None:
    reader, writer = ring
    got = writer.reserve(1000)
    assert got is not None
    with pytest.raises(RingError):
        reader.claim(position, length)  # type: ignore[arg-type]
    assert reader.outstanding() == 0
    array = reader.claim(got[0], 1000)  # a bad claim does not disturb the next good one
    assert len(array) == 1000


def test_duplicate_and_out_of_order_claims(ring: tuple[RingReader, RingWriter]) -> None:
    reader, writer = ring
    first = _put(writer, bytes(10))
    second = _put(writer, bytes(10))
    assert first is not None and second is not None
    keep = reader.claim(second, 10)  # the first was abandoned: its space is the gap
    with pytest.raises(RingError, match="out-of-order"):
        reader.claim(first, 10)
    with pytest.raises(RingError):
        reader.claim(second, 10)
    assert isinstance(RingError("x"), ValueError) and isinstance(RingError("x"), ZloaderError)
    del keep
    assert reader.tail == second + ALIGN


def test_writer_refuses_non_rings_and_closed_use() -> None:
    with Segment.create("test", 8192) as seg, pytest.raises(RingError):
        RingWriter(seg.name)
    with RingReader(1024) as reader:
        writer = RingWriter(reader.name)
        writer.close()
        writer.close()
        with pytest.raises(ValueError):
            writer.reserve(1)
    for bad in (0, 100, -64, True):
        with pytest.raises(ValueError):
            RingReader(bad)


_WRITER_SCRIPT = """
import sys
from zloader.transport.ring import RingWriter

with RingWriter(sys.argv[1]) as writer:
    for index in range(int(sys.argv[2])):
        length = 1 + index * 37 % 300
        position, view = writer.reserve(length)
        view[:] = bytes((index * 7 + k) % 251 for k in range(length))
        print(position, length, flush=True)
"""


def test_writer_in_a_second_process() -> None:
    count = 100
    with RingReader(64 * 1024) as reader:
        done = subprocess.run([sys.executable, "-c", _WRITER_SCRIPT, reader.name, str(count)],
                              capture_output=True, text=True, timeout=WAIT_S, check=False)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.split()
        records = [(int(lines[i]), int(lines[i + 1])) for i in range(0, len(lines), 2)]
        assert len(records) == count
        arrays = [reader.claim(position, length) for position, length in records]
        _check_intact((array, _pattern(index, len(array))) for index, array in enumerate(arrays))
        assert reader.outstanding() == count
        arrays.clear()
        assert reader.outstanding() == 0
        assert reader.tail == records[-1][0] + _round_up(records[-1][1])


def test_close_while_records_are_held() -> None:
    reader = RingReader(4096)
    writer = RingWriter(reader.name)
    position = _put(writer, _pattern(3, 500))
    assert position is not None
    array = reader.claim(position, 500)
    piece = memoryview(array)[100:200]
    reader.close()
    reader.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{reader.name}")
    assert bytes(array) == _pattern(3, 500)
    assert bytes(piece) == _pattern(3, 500)[100:200]
    with pytest.raises(ValueError):
        reader.claim(position, 500)
    writer.close()
    assert bytes(array) == _pattern(3, 500)  # still mapped through the array alone
    del array, piece
    gc.collect()
    assert reader.outstanding() == 0
    assert not _mapped(reader.name)


def test_release_from_another_thread() -> None:
    drop: queue.Queue[object] = queue.Queue()

    def dropper() -> None:
        while drop.get(timeout=WAIT_S) is not None:
            pass  # the array goes out of scope here, in this thread

    thread = threading.Thread(target=dropper)
    thread.start()
    try:
        with RingReader(8192) as reader, RingWriter(reader.name) as writer:
            for index in range(2000):
                data = _pattern(index, 1 + index % 500)
                for _ in range(10_000):
                    position = _put(writer, data)
                    if position is not None:
                        break
                    time.sleep(0.001)  # the dropper is behind; bounded retries
                assert position is not None
                drop.put(reader.claim(position, len(data)))
            drop.put(None)
            thread.join(timeout=WAIT_S)
            assert not thread.is_alive()
            assert reader.outstanding() == 0
            assert reader.tail == writer.head
    finally:
        drop.put(None)
        thread.join(timeout=WAIT_S)


@pytest.mark.timeout(60)
def test_garbage_collection_during_claim_does_not_deadlock() -> None:
    # Arrays in reference cycles are freed by the cyclic GC, which can run inside claim()
    # while it holds the reader's lock, on the same thread.
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        with RingReader(4096) as reader, RingWriter(reader.name) as writer:
            for index in range(500):
                position = _put(writer, _pattern(index, 200))
                if position is None:
                    gc.collect()
                    position = _put(writer, _pattern(index, 200))
                assert position is not None
                cycle: list[object] = [reader.claim(position, 200)]
                cycle.append(cycle)
                del cycle
            gc.collect()
            assert reader.outstanding() == 0
            assert reader.tail == writer.head
    finally:
        gc.set_threshold(*old)


def test_default_capacity_constant() -> None:
    assert DEFAULT_RING_BYTES % ALIGN == 0 and DATA_OFFSET % ALIGN == 0


# --- credits given back in the header ------------------------------------------------------


def test_a_credits_word_counts_past_2_32_and_names_its_open():
    word = credits_word(7, 5)
    assert open_of(word) == 7 and credits_since(word, 7, 2) == 3
    assert credits_since(word, 8, 2) == 0  # (another OPEN's: none of this one's)
    assert credits_since(word, 7, 5) == 0
    # the count wraps: 3 past 2**32 - 1 after 2**32 - 2 taken is 5 more
    wrapped = credits_word(7, COUNT_MASK + 4)
    assert credits_since(wrapped, 7, COUNT_MASK - 1) == 5
    # a read behind what was taken (a stale one) gives nothing, never 2**32 - n
    assert credits_since(credits_word(7, 10), 7, 12) == 0
    # OPEN numbers are 32-bit too (the consumer's wrap to 1 after 2**32 - 1)
    assert open_of(credits_word(COUNT_MASK + 3, 0)) == 2


def test_the_header_carries_credits_one_way_and_waits_the_other():
    with RingReader(4096) as reader, RingWriter(reader.name) as writer:
        assert writer.credits() == 0 and reader.taken() == 0 and reader.starving() == 0
        reader.give(credits_word(3, 9))
        assert writer.credits() == credits_word(3, 9)
        writer.take(3)
        assert reader.taken() == 3 and reader.starving() == 0  # (taken, no wait said)
        writer.starve(credits_word(3, 2))
        assert reader.starving() == credits_word(3, 2) and reader.taken() == 3
        writer.starve(0)
        assert reader.starving() == 0
        # the words are the header's: a record's bytes never touch them
        position = _put(writer, b"x" * 100)
        assert bytes(reader.claim(position, 100)) == b"x" * 100
        assert writer.credits() == credits_word(3, 9) and reader.taken() == 3
    assert writer.credits() == 0  # (closed: nothing)
