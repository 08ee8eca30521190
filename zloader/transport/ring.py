"""A single-producer single-consumer ring of variable-size records in shared memory.

The consumer process creates and owns the ring (:class:`RingReader`); one worker process
attaches and writes (:class:`RingWriter`). Record positions travel from writer to reader
out of band (over the ZeroMQ socket, in order): the writer reserves space with
:meth:`RingWriter.reserve`, fills the returned memoryview, and sends ``(position,
length)``; the reader takes that record with :meth:`RingReader.claim` and gets a
zero-copy numpy array of its bytes. When that array and everything built on it have
been garbage collected, the record is released and its space is free again.

Positions are cumulative byte counts since the ring was created (they never wrap; 2**64
bytes is centuries of traffic); a position's offset in the data region is ``position %
capacity``. Every record starts at a multiple of ``ALIGN`` and occupies its length
rounded up to ``ALIGN``.

Position and padding protocol:

1. The writer keeps ``head``, the end of its last reservation.
2. A record that would run past the end of the data region is placed at the region
   start instead; the bytes skipped (``capacity - head % capacity``) are padding.
3. ``reserve`` returns the record's own first byte's position: the padding is not
   part of the record, but it is the gap between the previous record's end and it.
4. The reader keeps ``cursor``, the end of the last record it claimed; a record's gap
   (``position - cursor``) is freed together with that record.
5. The reader frees space in order: ``tail`` moves over the longest run of released
   records (and their gaps) from the oldest one; the writer reads ``tail`` to know
   what is free (``capacity - (head - tail)``).

6. Restart: the writer may place a record at the next region start although it would fit
   at ``head``, when at least ``RING_RESTART_BYTES`` and the record's own rounded length
   lie between the region start and ``head`` (:func:`_restarts`: how the reader knows
   one). Its gap is then freed with the records before it, not with it: the reader frees
   it at once when nothing before it is claimed and unreleased, and otherwise extends the
   last claimed record over it. The writer restarts when the ring is empty, or when the
   live records lie in the region's current lap and leave room for ``RING_RESTART_ROOM``
   records of this one's size before the oldest of them (until that one is released, the
   ring holds no more than that), so that a consumer that keeps up has its records
   written over the same few megabytes, which the CPU's caches still hold, instead of
   through the whole ring: with 9.6 MB records a 64 MiB ring per worker made every copy
   into it, and the pipeline's fresh arrays, miss the caches (bench.transport section h).
   Positions advance by up to a capacity per restart, so restarts stop past a quarter of
   the position space (``2**62``: years at memory speed).

A reservation the writer abandons (never sends) therefore costs nothing permanent: its
bytes become part of the next sent record's gap. Zero-length records are not placed in
the ring (``reserve(0)`` returns None; send empty payloads inline).

Segment layout (native byte order, both sides are on one host)::

    offset 0      header, 64 bytes: magic b"ZLRING02", capacity:u64, tail:u64, head:u64,
                  credits:u64, starving:u64, taken:u64
    offset 4096   data region, capacity bytes

The last three words carry the stream's credits (docs/protocol.md, "Flow control"), so
that a consumer gives a co-located worker its credits back without a message: ``credits``
(written by the reader) is ``(open << 32) | count``, the credits given back since the
consumer's OPEN numbered ``open`` (``OPEN.counter``), the count modulo 2**32; ``taken``
(written by the writer) is the OPEN number whose credits the worker takes from
``credits``; ``starving`` (written by the writer) is ``(open << 32) | episode``, raised
each time the worker waits for credits, which the consumer answers with a CREDIT message
to wake it. Each side writes its word, then a full memory barrier
(``zloader._native.fence``), then reads the other's.

The data region starts on its own page so that it is page-aligned and the header's
cache line is never shared with record bytes. ``tail`` is written only by the reader,
``head`` only by the writer (which publishes it so the reader can check that a claimed
record was actually reserved). Both are aligned 8-byte words, written and read as single
8-byte accesses, so neither side ever sees half an update.

Memory: the reader reserves the header page only. The writer reserves the data region
(``posix_fallocate``) from its start as its records reach into it: RING_RESERVE_BYTES when
it attaches, then at least twice as much each time a record lies past what it reserved
(when /dev/shm has no room for more, that record goes another way, as when the ring is
full). With the restarts of rule 6, a consumer that keeps up with small records has them
written over the first few MiB, so a ring costs the memory its records use, not its
capacity. A background thread (:class:`~zloader.transport.prefault.Prefaulter`) faults
the first reservation in, so the first record waits neither for the kernel to zero the
ring nor for a mapping of it. Later reservations fault in as records are written into
them: faulted ahead, the unused rest of a doubling would be memory the writer alone
holds (and its USS), for nothing.
"""

from __future__ import annotations

import collections
import logging
import operator
import threading
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from zloader._defaults import (
    DEFAULT_RING_BYTES,
    RING_RESERVE_BYTES,
    RING_RESTART_BYTES,
    RING_RESTART_ROOM,
)
from zloader.errors import ZloaderError
from zloader.transport.prefault import Prefaulter
from zloader.transport.shm import Segment, ShmError

if TYPE_CHECKING:  # (for annotations only)
    import numpy.typing as npt

__all__ = [
    "ALIGN",
    "COUNT_MASK",
    "DATA_OFFSET",
    "DEFAULT_RING_BYTES",
    "RingError",
    "RingReader",
    "RingWriter",
    "credits_since",
    "credits_word",
    "open_of",
]

log = logging.getLogger("zloader.ring")

ALIGN = 64
"""Records start at multiples of this many bytes (a cache line; enough for any dtype)."""
DATA_OFFSET = 4096
"""Offset of the data region in the segment: one page, the first 64 bytes of it the header."""
MAGIC = b"ZLRING02"
"""The ring's version: 02 restarts at the region start (rule 6), which a 01 reader would
refuse; a writer and a reader of different versions do not attach (records go over the
socket)."""
KIND = "ring"

# Indices of the header's u64 words.
_CAPACITY, _TAIL, _HEAD, _CREDITS, _STARVING, _TAKEN = 1, 2, 3, 4, 5, 6
_COUNT_BITS = 32  # a credits word: (OPEN number << 32) | credits given back (mod 2**32)
COUNT_MASK = (1 << _COUNT_BITS) - 1


def credits_word(opened: int, count: int) -> int:
    """The ``credits`` word of ``count`` credits given back since OPEN number ``opened``."""
    return ((opened & COUNT_MASK) << _COUNT_BITS) | (count & COUNT_MASK)


def open_of(word: int) -> int:
    """The OPEN number of a ``credits`` or ``starving`` word."""
    return word >> _COUNT_BITS


def credits_since(word: int, opened: int, counted: int) -> int:
    """The credits a ``credits`` word gives back beyond the ``counted`` (mod 2**32) taken
    already, when it is of OPEN number ``opened`` (else 0: of another OPEN)."""
    if open_of(word) != opened & COUNT_MASK:
        return 0
    more = (word - counted) & COUNT_MASK
    return more if more < 1 << (_COUNT_BITS - 1) else 0  # (behind: a stale read)


_HEADER_WORDS = 8  # 64 bytes
_POSITION_LIMIT = 2**64


class RingError(ZloaderError, ValueError):
    """A record position from the peer is impossible, or the ring's header is corrupt."""


def _round_up(length: int) -> int:
    return (length + ALIGN - 1) // ALIGN * ALIGN


def _restarts(cursor: int, position: int, rounded: int, capacity: int) -> bool:
    """Whether a record of ``rounded`` bytes at ``position``, after one that ended at
    ``cursor``, is a restart (rule 6): at the next region start, although it fits before
    the region's end, with ``RING_RESTART_BYTES`` and itself between its start and
    ``cursor``."""
    offset = cursor % capacity
    return (offset > 0 and position == cursor + capacity - offset
            and offset + rounded <= capacity and offset >= max(rounded, RING_RESTART_BYTES)
            and cursor < _POSITION_LIMIT // 4)  # positions leap: see rule 6


def _header(segment: Segment) -> memoryview:
    # cast("Q") makes each word a native, aligned 8-byte access.
    return segment.buf[: _HEADER_WORDS * 8].cast("Q")


class RingWriter:
    """The producing side of a ring: attaches to the reader's segment by name.

    Not thread-safe: one thread of one process writes a ring.
    """

    def __init__(self, name: str) -> None:
        """Attach to the ring called ``name``.

        Args:
            name: :attr:`RingReader.name`, sent by the consumer.

        Raises:
            RingError: the segment is not a ring (bad magic or capacity).
            ShmError: ``/dev/shm`` has no room for the ring's data (this writer reserves
                it: the reader reserved only the header).
            FileNotFoundError: no such segment.
            ValueError: ``name`` is not a zloader segment name.
        """
        # The reader reserved its header only: this writer reserves the data region as it
        # writes (never a SIGBUS on write), and faults its pages in behind the first records.
        segment = Segment.attach(name, populate=False)
        try:
            if segment.size < DATA_OFFSET or bytes(segment.buf[: len(MAGIC)]) != MAGIC:
                raise RingError(f"segment {name!r} is not a zloader ring")
            header = _header(segment)
            capacity = header[_CAPACITY]
            if (capacity < ALIGN or capacity % ALIGN
                    or capacity > segment.size - DATA_OFFSET):
                header.release()
                raise RingError(f"ring {name!r} has a corrupt header (capacity {capacity} "
                                f"in a segment of {segment.size} bytes)")
        except BaseException:
            segment.close()
            raise
        self.name = name
        self.capacity: int = capacity
        self._segment = segment
        self._header: memoryview | None = header
        self._data: memoryview | None = segment.buf[DATA_OFFSET:DATA_OFFSET + capacity]
        # Resume after a previous writer: positions continue from its head.
        self._head: int = header[_HEAD]
        # This writer's last restart (rule 6), as (the head before it, its position): once
        # the tail reaches that head, the reader frees the gap up to the position too.
        self._restart = (-1, 0)
        self._reserved = 0  # bytes of the data region reserved, from its start
        self._prefaults: list[Prefaulter] = []
        try:
            self._reserve_to(min(capacity, RING_RESERVE_BYTES), strict=True)
        except BaseException:
            self.close()
            raise

    @property
    def head(self) -> int:
        """Cumulative position just past the last reservation."""
        return self._head

    def fill(self) -> float:
        """The share of the ring written and not yet released by the reader (0 to 1)."""
        if self._header is None:
            return 0.0
        used = self._head - self._free(self._header[_TAIL])
        return min(1.0, max(0.0, used / self.capacity))

    def credits(self) -> int:
        """The header's ``credits`` word (0 once closed)."""
        header = self._header
        return header[_CREDITS] if header is not None else 0

    def take(self, opened: int) -> None:
        """Say in the header that this writer takes the credits of OPEN number ``opened``
        from its ``credits`` word."""
        if self._header is not None:
            self._header[_TAKEN] = opened & COUNT_MASK

    def starve(self, word: int) -> None:
        """Write the header's ``starving`` word: ``credits_word(opened, n)``, the n-th
        wait of this writer for the credits of OPEN number ``opened``; 0: not waiting."""
        if self._header is not None:
            self._header[_STARVING] = word

    def _free(self, tail: int, restart: tuple[int, int] | None = None) -> int:
        """Where free space starts, given the header's ``tail``: past the gap of the last
        restart (``restart``, else this writer's) once everything before it is released
        (rule 6)."""
        before, position = self._restart if restart is None else restart
        return position if tail == before else tail

    def reserve(self, length: int) -> tuple[int, memoryview] | None:
        """Reserve space for a record of ``length`` bytes, without waiting.

        Args:
            length: the record's size in bytes.

        Returns:
            ``(position, view)``: the cumulative position of the record's first byte,
            to send to the reader, and a writable memoryview of exactly ``length`` bytes
            to fill first. None when the ring has no room right now, and always for
            ``length == 0`` or a length that rounded up to ``ALIGN`` exceeds the
            capacity: send the record another way then.

        Raises:
            ValueError: negative ``length``, or the writer is closed.
            RingError: the header's tail is impossible (the segment is corrupt).
        """
        length = operator.index(length)
        if length < 0:
            raise ValueError(f"record length must be >= 0, got {length}")
        if self._header is None or self._data is None:
            raise ValueError(f"ring writer {self.name!r} is closed")
        rounded = _round_up(length)
        capacity = self.capacity
        if length == 0 or rounded > capacity:
            return None
        head = self._head
        offset = head % capacity
        tail = self._header[_TAIL]
        free = self._free(tail)
        if tail > head or head - free > capacity:
            raise RingError(f"ring {self.name!r} has a corrupt tail {tail} "
                            f"(head {head}, capacity {capacity})")
        live = head - free  # bytes of records not released yet (and their gaps)
        restart = self._restart
        if offset + rounded > capacity:
            head += capacity - offset  # padding: skip to the region start
        elif ((live == 0 or offset - live >= RING_RESTART_ROOM * rounded)
              and _restarts(head, head + capacity - offset, rounded, capacity)):
            # Start again at the region start, where the caches are warm (rule 6).
            restart = (head, head + capacity - offset)
            head += capacity - offset
            free = self._free(tail, restart)
        if head + rounded - free > capacity:
            return None
        offset = head % capacity
        if offset + rounded > self._reserved and not self._reserve_to(offset + rounded):
            return None
        self._restart = restart
        self._head = head + rounded
        self._header[_HEAD] = self._head
        return head, self._data[offset:offset + length]

    @property
    def reserved(self) -> int:
        """Bytes of the data region reserved so far (the memory this ring takes)."""
        return self._reserved

    def _reserve_to(self, end: int, strict: bool = False) -> bool:
        """Reserve the data region up to ``end`` at least (twice what was reserved, or
        RING_RESERVE_BYTES, if more; never past the capacity); the first reservation
        (``strict``) starts faulting its pages in. False when /dev/shm has no room
        (``strict``: raise ShmError)."""
        start = self._reserved
        target = min(self.capacity, max(end, 2 * start, RING_RESERVE_BYTES))
        try:
            self._segment.reserve(DATA_OFFSET + start, DATA_OFFSET + target)
        except (ShmError, OSError):
            if strict:
                raise
            log.debug("ring %s: no room in /dev/shm to reserve %d bytes more; the record "
                      "goes another way", self.name, target - start)
            return False
        self._reserved = target
        if strict:
            self._prefaults.append(Prefaulter(self._segment.buf, DATA_OFFSET + start,
                                              DATA_OFFSET + target, DATA_OFFSET + start))
        return True

    def close(self) -> None:
        """Detach from the ring; idempotent. Views returned by reserve stay valid (and so
        does the mapping, until the prefaulting threads have stopped too)."""
        header, data = self._header, self._data
        self._header = self._data = None
        for prefault in self._prefaults:
            prefault.close()
        if header is not None:
            header.release()
        if data is not None:
            data.release()
        self._segment.close()

    def __enter__(self) -> RingWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class _Record:
    """A claimed record: where it (with its gap) ends, whether it has been released, and
    the weak reference to its array whose callback releases it."""

    __slots__ = ("end", "hold", "released")

    def __init__(self, end: int) -> None:
        self.end = end
        self.released = False
        self.hold: _Hold | None = None


class _Hold(weakref.ref):  # type: ignore[type-arg,unused-ignore]
    """A weak reference to a claimed array that knows its record: its callback (the
    reader's) releases the record once the array is collected. Cheaper than a
    ``weakref.finalize`` per record (no registry, no atexit entry); kept alive by its
    record until then."""

    __slots__ = ("record",)
    record: _Record

    def __new__(cls, array: Any, callback: Any, record: _Record) -> _Hold:
        hold = super().__new__(cls, array, callback)
        hold.record = record
        return hold

    def __init__(self, array: Any, callback: Any, record: _Record) -> None:
        super().__init__(array, callback)  # type: ignore[call-arg,unused-ignore]


class RingReader:
    """The consuming side of a ring: creates and owns the shared-memory segment.

    Thread-safe: records may be claimed from one thread and released (garbage
    collected) in any.

    Attributes:
        name: the segment's name, for :class:`RingWriter`.
        capacity: size of the data region in bytes.
    """

    def __init__(self, capacity: int = DEFAULT_RING_BYTES, kind: str = KIND) -> None:
        """Create a ring with ``capacity`` bytes of data space.

        Args:
            capacity: data bytes; a positive multiple of ``ALIGN`` (the ``ring_bytes``
                setting).
            kind: the segment kind used in its name (see ``segment_name``).

        Raises:
            ValueError: bad ``capacity`` or ``kind``.
            ShmError: ``/dev/shm`` has no room for the ring.
        """
        if (not isinstance(capacity, int) or isinstance(capacity, bool)
                or capacity < ALIGN or capacity % ALIGN):
            raise ValueError(f"ring capacity must be a positive multiple of {ALIGN} bytes, "
                             f"got {capacity!r}")
        segment = Segment.create(kind, DATA_OFFSET + capacity, reserve=DATA_OFFSET)
        self.name = segment.name
        self.capacity = capacity
        self._segment = segment
        segment.buf[: len(MAGIC)] = MAGIC
        self._header: memoryview | None = _header(segment)
        self._header[_CAPACITY] = capacity  # tail and head start at 0: the file is zeroed
        self._lock = threading.Lock()
        self._claimed: collections.deque[_Record] = collections.deque()
        # Releases are queued here by finalizers and applied by whoever holds the lock,
        # so a finalizer never blocks (it may run inside claim, on the same thread).
        self._pending: collections.deque[_Record] = collections.deque()
        self._cursor = 0  # end of the last claimed record
        self._tail = 0  # end of the released prefix; mirrored in the header
        self._outstanding = 0

    @property
    def tail(self) -> int:
        """Cumulative position up to which space has been freed."""
        self._drain()
        return self._tail

    def give(self, word: int) -> None:
        """Write the header's ``credits`` word (:func:`credits_word`): the consumer's
        credits given back to this ring's writer."""
        if self._header is not None:
            self._header[_CREDITS] = word

    def taken(self) -> int:
        """The OPEN number whose credits the writer takes from the header (0: none)."""
        return self._header[_TAKEN] if self._header is not None else 0

    def starving(self) -> int:
        """The writer's latest wait for credits, ``(open << 32) | episode`` (0: none)."""
        return self._header[_STARVING] if self._header is not None else 0

    def claim(self, position: int, length: int) -> npt.NDArray[np.uint8]:
        """Take the record the writer reported, as a zero-copy array.

        Records must be claimed in the order they were reserved, each once.

        Args:
            position: the record's position, as returned by :meth:`RingWriter.reserve`.
            length: the record's length in bytes.

        Returns:
            A writable uint8 array of shape ``(length,)`` over the record's bytes in
            shared memory. Build everything from this array (slices, memoryviews,
            ``np.frombuffer``): the record is released once it and all of them are
            garbage collected, never earlier.

        Raises:
            RingError: ``(position, length)`` cannot be a record of this ring now (a
                duplicate, out of order, not reserved, overlapping live records, or
                running past the end of the data region).
            ValueError: the reader is closed.
        """
        try:
            position = operator.index(position)
            length = operator.index(length)
        except TypeError:
            raise RingError(f"record position and length must be ints, got "
                            f"{position!r}, {length!r}") from None
        with self._lock:
            if self._header is None:
                raise ValueError(f"ring {self.name!r} is closed")
            self._advance()
            restart = _restarts(self._cursor, position, _round_up(length), self.capacity)
            # A restart's gap is freed with the records before it (rule 6): now, if none
            # is live.
            free = position if restart and not self._claimed else self._tail
            self._check(position, length, self._header[_HEAD], free)
            if restart and self._claimed:
                self._claimed[-1].end = position
            elif free != self._tail:
                self._tail = free
                self._header[_TAIL] = free
            offset = DATA_OFFSET + position % self.capacity
            array = np.frombuffer(self._segment.buf, dtype=np.uint8, count=length,
                                  offset=offset)
            record = _Record(position + _round_up(length))
            self._claimed.append(record)
            self._cursor = record.end
            self._outstanding += 1
            record.hold = _Hold(array, self._on_release, record)
        self._drain()
        return array

    def _check(self, position: int, length: int, head: int, tail: int) -> None:
        """Raise RingError unless ``(position, length)`` can be the next record.

        ``head`` is the writer's published head: a record must lie before it; ``tail``:
        where free space starts, the record's gap freed or not.
        """
        capacity = self.capacity
        rounded = _round_up(length)
        if (length >= 1 and rounded <= capacity and position >= 0 and not position % ALIGN
                and position + rounded < _POSITION_LIMIT and position >= self._cursor
                and position % capacity + rounded <= capacity
                and position + rounded - tail <= capacity
                and position + rounded <= head):
            return  # (every record read passes here: the reasons are spelled out below)
        where = f"ring record at position {position} of length {length}"
        if length < 1:
            raise RingError(f"{where}: length must be at least 1")
        if rounded > capacity:
            raise RingError(f"{where}: longer than the ring's capacity {capacity}")
        if position < 0 or position % ALIGN or position + rounded >= _POSITION_LIMIT:
            raise RingError(f"{where}: position must be a multiple of {ALIGN} in "
                            f"[0, 2**64)")
        if position < self._cursor:
            raise RingError(f"{where}: starts before the end of the previous record "
                            f"({self._cursor}); duplicate or out-of-order record")
        if position % capacity + rounded > capacity:
            raise RingError(f"{where}: runs past the end of the data region "
                            f"(capacity {capacity})")
        if position + rounded - tail > capacity:
            raise RingError(f"{where}: overlaps unreleased records (free space starts at "
                            f"{tail}, capacity {capacity})")
        raise RingError(f"{where}: not reserved by the writer (its head is {head})")

    def _on_release(self, hold: _Hold) -> None:
        """Callback of a claimed array's weak reference: queue its record's release.
        Never raises."""
        try:
            record = hold.record
            record.hold = None
            self._pending.append(record)
            self._drain()
        except Exception:  # pragma: no cover - a finalizer has nobody to raise to
            pass

    def _drain(self) -> None:
        """Apply queued releases unless another holder of the lock will."""
        # A finalizer appends before trying the lock, and a holder drains after letting
        # go of it, so a release queued while the lock is held is never left behind.
        while self._pending:
            if not self._lock.acquire(blocking=False):
                return
            try:
                self._advance()
            finally:
                self._lock.release()

    def _advance(self) -> None:
        """Mark queued records released and move the tail over the released prefix."""
        while self._pending:
            record = self._pending.popleft()
            record.released = True
            self._outstanding -= 1
        tail = self._tail
        claimed = self._claimed
        while claimed and claimed[0].released:
            tail = claimed.popleft().end
        if tail != self._tail:
            self._tail = tail
            if self._header is not None:
                self._header[_TAIL] = tail

    def outstanding(self) -> int:
        """Number of claimed records not yet released."""
        with self._lock:
            self._advance()
            count = self._outstanding
        self._drain()
        return count

    def close(self) -> None:
        """Unlink the ring's segment and drop this reader's mapping; idempotent.

        Arrays returned by :meth:`claim` stay valid: the memory stays mapped until the
        last of them is garbage collected. The name disappears from ``/dev/shm`` now.
        """
        with self._lock:
            header, self._header = self._header, None
        if header is None:
            return
        header.release()
        self._segment.unlink()
        self._segment.close()
        self._drain()

    def __enter__(self) -> RingReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<RingReader {self.name!r} capacity={self.capacity} "
                f"outstanding={self._outstanding}>")
