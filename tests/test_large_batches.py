"""Fresh large batches (bench.transport section h): a worker keeps few of a pipeline's fresh
arrays alive at a time, and a ring's writer restarts at the region start when its consumer
keeps up (zloader/transport/ring.py, rule 6), so that records are made and copied in memory
the CPU's caches still hold; every record still arrives whole, once, whatever the consumer
holds. Real shared memory, real worker processes."""

from __future__ import annotations

import random
import weakref
from typing import Any

import numpy as np
import pytest

from tests.service import read_together, service
from zloader import Loader, Pipeline
from zloader._defaults import LARGE_RECORD_BYTES, RING_RESTART_BYTES, RING_RESTART_ROOM
from zloader.transport.ring import ALIGN, RingError, RingReader, RingWriter
from zloader.transport.shm import Segment

MIB = 1 << 20
CAPACITY = 16 * MIB
RECORD = 3 * MIB // 2  # a large record: 10 fit the ring
SLOT = -(-RECORD // ALIGN) * ALIGN


def _write(writer: RingWriter, seed: int, length: int) -> int | None:
    """Reserve and fill a record of ``length`` bytes of ``seed``; its position, or None."""
    got = writer.reserve(length)
    if got is None:
        return None
    position, view = got
    np.frombuffer(view, np.uint8)[:] = seed % 251
    view.release()
    return position


def _intact(records: list[tuple[np.ndarray, int]]) -> bool:
    return all(bool((array == seed % 251).all()) for array, seed in records)


def test_a_reader_that_keeps_up_has_large_records_written_over_the_same_memory() -> None:
    """Released at once, every record restarts at the region start; with one held while the next
    is written, they cycle over RING_RESTART_ROOM + 1 slots. Before, they swept the whole
    ring, out of the caches once rings outgrew them."""
    assert RECORD >= RING_RESTART_BYTES and SLOT * (RING_RESTART_ROOM + 2) < CAPACITY
    with RingReader(CAPACITY) as reader, RingWriter(reader.name) as writer:
        offsets = set()
        for seed in range(30):
            position = _write(writer, seed, RECORD)
            assert position is not None
            offsets.add(position % CAPACITY)
            array = reader.claim(position, RECORD)
            assert _intact([(array, seed)])
            del array
        assert offsets == {0}
        held: list[tuple[np.ndarray, int]] = []
        offsets.clear()
        for seed in range(30):
            position = _write(writer, seed, RECORD)
            assert position is not None
            offsets.add(position % CAPACITY)
            held.append((reader.claim(position, RECORD), seed))
            assert _intact(held)
            held = held[-1:]  # the consumer holds the last record only
        assert max(offsets) <= RING_RESTART_ROOM * SLOT
        held.clear()
        assert reader.outstanding() == 0


def test_a_restart_frees_its_gap_with_the_records_before_it() -> None:
    """A record placed at the region start while an earlier one is live: the ring holds
    RING_RESTART_ROOM records of its size until that one is released, then all of it."""
    with RingReader(CAPACITY) as reader, RingWriter(reader.name) as writer:
        arrays = []
        for seed in range(RING_RESTART_ROOM + 1):
            position = _write(writer, seed, RECORD)
            assert position == seed * SLOT
            arrays.append(reader.claim(position, RECORD))
        last = arrays.pop()
        arrays.clear()  # one live record, RING_RESTART_ROOM slots from the region start
        restart = _write(writer, 100, RECORD)
        assert restart == CAPACITY, "the record did not restart at the region start"
        held = [(reader.claim(restart, RECORD), 100)]
        for seed in range(101, 100 + RING_RESTART_ROOM):  # the room before the live one
            position = _write(writer, seed, RECORD)
            assert position is not None
            held.append((reader.claim(position, RECORD), seed))
        assert _write(writer, 200, RECORD) is None  # the live one pins the rest
        assert _intact([(last, RING_RESTART_ROOM), *held])
        del last
        assert reader.tail == restart  # its gap went with it
        while (position := _write(writer, 300, RECORD)) is not None:
            held.append((reader.claim(position, RECORD), 300))
        assert len(held) == CAPACITY // SLOT
        assert _intact(held)


def test_restarts_keep_every_record_intact_under_random_holds() -> None:
    """Records of random sizes, held and released in random order, with restarts among
    them: every live record stays intact, the reader accepts every record, and a ring the
    consumer emptied takes any record that fits it."""
    rng = random.Random(26)
    restarts = 0
    with RingReader(CAPACITY) as reader, RingWriter(reader.name) as writer:
        live: list[tuple[np.ndarray, int]] = []
        for seed in range(600):
            length = rng.randint(MIB // 2, 3 * MIB)
            head = writer.head
            position = _write(writer, seed, length)
            if position is None:
                live.clear()  # the consumer lets go of everything
                position = _write(writer, seed, length)
                assert position is not None, "an empty ring refused a record that fits"
            restarts += position != head and head % CAPACITY + length <= CAPACITY
            live.append((reader.claim(position, length), seed))
            assert _intact(live)
            keep = rng.choice([0, 1, 1, 2, 3, 6])
            while len(live) > keep:
                live.pop(rng.randrange(len(live)))
        live.clear()
        assert reader.outstanding() == 0 and reader.tail == writer.head
    assert restarts > 50


def test_a_writer_refuses_a_ring_of_the_previous_version() -> None:
    """A version 01 ring (no restarts) is not written by this writer: records go over the
    socket rather than in positions its reader would refuse."""
    with Segment.create("ring", 4096 + 4096) as segment:
        segment.buf[:8] = b"ZLRING01"
        segment.buf[8:16] = (4096).to_bytes(8, "little")
        with pytest.raises(RingError, match="not a zloader ring"):
            RingWriter(segment.name)
        segment.unlink()


class _Alive:
    """A map making a fresh array of ``nbytes`` for each element and saying how many of
    the arrays it made before are still alive (in this worker process)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.made: list[Any] = []

    def __call__(self, i: int) -> dict[str, Any]:
        self.made = [ref for ref in self.made if ref() is not None]
        alive = len(self.made)
        array = np.full(self.nbytes, i % 251, np.uint8)
        self.made.append(weakref.ref(array))
        return {"image": array, "alive": alive, "i": i}


def test_a_worker_keeps_few_fresh_large_arrays_alive() -> None:
    """The producer waits until the loop has copied a large record out before it makes the
    next, so the map's previous array (still held by the stage) is the only other one
    alive. Before, it made a record per credit ahead of the copies: up to nine alive, each
    new one in memory that had left the caches."""
    assert 2 * MIB >= LARGE_RECORD_BYTES
    count = 200
    pipeline = Pipeline.range(count, split_size=count).map(_Alive(2 * MIB))  # one split
    with Loader(pipeline, num_workers=1, prefetch=8, timeout=60) as loader:
        alive = [int(element["alive"]) for element in loader]
    assert len(alive) == count
    assert max(alive) <= 2, alive


def _fresh(i: int) -> np.ndarray:
    return np.full(RECORD, i % 251, np.uint8)


def test_fresh_large_batches_arrive_whole_and_once() -> None:
    """Read and dropped one by one (the ring restarts), and held all at once (the ring
    fills, records take segments of their own): every batch whole, each once."""
    count = 48
    with Loader(Pipeline.range(count).map(lambda i: (i, _fresh(i))), num_workers=2,
                ring_bytes=CAPACITY, timeout=60) as loader:
        seen = []
        for i, array in loader:
            assert array.shape == (RECORD,) and (array == i % 251).all()
            seen.append(int(i))
        assert sorted(seen) == list(range(count))
        held = list(loader)
        assert sorted(int(i) for i, _ in held) == list(range(count))
        assert all((array == i % 251).all() for i, array in held)


def test_coordinated_reads_of_large_records_finish() -> None:
    """A round waits for N records of one worker: the producer of a large record must not
    wait for a record the round keeps (rounds mark what they keep taken)."""
    with service(1) as (address, _):
        loaders = [Loader(Pipeline.range(24).map(_fresh), broker=address, job_name="big",
                          num_consumers=2, consumer_index=j, timeout=30) for j in range(2)]
        try:
            results = read_together(loaders, element=lambda a: int(a[0]))
        finally:
            for loader in loaders:
                loader.close()
    got = sorted(results[0][0] + results[1][0])
    assert len(results[0][0]) == len(results[1][0]) == 12
    assert got == sorted(i % 251 for i in range(24))
