"""A ring's writer does not make its first record wait for the whole ring's pages: it
reserves the start of the ring when it attaches, and a background thread faults the pages
in behind the first records (zloader/transport/prefault.py), as it does for each later
reservation. Measured on a 2-core host, the kernel's zeroing of two 64 MiB rings was most
of a cheap first epoch's extra time."""

from __future__ import annotations

import ctypes

import numpy as np

from zloader import Loader, Pipeline
from zloader.transport.ring import RingReader, RingWriter

MIB = 1 << 20


def resident_bytes(buf: memoryview) -> int:
    """How much of the mapping that ``buf`` starts is mapped into this process now (Rss)."""
    anchor = ctypes.c_char.from_buffer(buf)
    address = ctypes.addressof(anchor)
    del anchor
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if "-" in head and ":" not in head:
                found = int(head.split("-")[0], 16) == address
            elif found and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping starts at {address:#x}")


def test_ring_writer_attach_returns_before_the_ring_is_faulted_in():
    """Attaching maps the ring without faulting it in (it used to wait for all 256 MiB to
    be zeroed and mapped); the writer's background thread then maps every page it
    reserved. A later reservation is faulted in only as records are written into it: a
    ring that doubled for one record does not hold the rest of the doubling in memory."""
    with RingReader(256 * MIB) as reader:
        writer = RingWriter(reader.name)
        try:
            assert resident_bytes(writer._segment.buf) < 128 * MIB
            position, view = writer.reserve(100)
            view[:] = b"x" * 100  # the first record goes in at once
            assert bytes(reader.claim(position, 100)) == b"x" * 100
            assert all(p.done.wait(60) for p in writer._prefaults), "prefaulting unfinished"
            first = writer.reserved
            assert resident_bytes(writer._segment.buf) >= first
            position, view = writer.reserve(10 * MIB)  # reserves more
            assert writer.reserved >= 10 * MIB > first
            view[-MIB:] = b"y" * MIB  # past the first reservation
            resident = resident_bytes(writer._segment.buf)
            assert first + MIB <= resident < writer.reserved - 4 * MIB
        finally:
            writer.close()


def test_a_writer_closed_while_prefaulting_keeps_its_records_and_leaks_nothing():
    """Closing the writer stops its thread; the records it wrote stay readable, and the
    segment goes when the reader closes (the no_leaks fixture checks /dev/shm)."""
    reader = RingReader(64 * MIB)
    writer = RingWriter(reader.name)
    slots = []
    for value in range(4):
        position, view = writer.reserve(MIB)
        view[:] = bytes([value]) * MIB
        slots.append(position)
    writer.close()
    writer.close()  # idempotent
    assert all(p.done.wait(30) for p in writer._prefaults)
    arrays = [reader.claim(position, MIB) for position in slots]
    assert [int(array[-1]) for array in arrays] == [0, 1, 2, 3]
    reader.close()
    assert all(np.all(array == i) for i, array in enumerate(arrays))  # still mapped


def test_a_ring_reattached_after_a_writer_resumes_where_it_stopped():
    """A second writer (a worker given the ring again) resumes at the first one's head,
    reserves what its records need, and its records follow the first writer's."""
    with RingReader(4 * MIB) as reader:
        with RingWriter(reader.name) as first:
            position, view = first.reserve(3 * MIB)
            view[:] = b"a" * 3 * MIB
        assert bytes(reader.claim(position, 3 * MIB)[:1]) == b"a"
        with RingWriter(reader.name) as second:
            assert second.head == 3 * MIB and reader.outstanding() == 0
            later = second.reserve(2 * MIB)
            assert later is not None and later[0] == 4 * MIB  # wrapped: padding skipped
            later[1][:] = b"b" * 2 * MIB
            assert bytes(reader.claim(later[0], 2 * MIB)[-1:]) == b"b"
            assert all(p.done.wait(30) for p in second._prefaults)


def test_loader_epochs_are_whole_with_prefaulted_rings():
    """Records written while the rings are still being faulted in arrive whole."""
    with Loader(Pipeline.range(5000).map(lambda x: np.full(1000, x, np.int32)),
                num_workers=2) as loader:
        for _ in range(2):
            seen = sorted(int(a[0]) for a in loader if np.all(a == a[0]))
            assert seen == list(range(5000))
