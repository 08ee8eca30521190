"""The consumers a worker serves and how records reach them.

A :class:`Stream` is one consumer reading the worker's task (its identity on the data
socket, its epoch, its credits, its ring). The :class:`Outlet` owns the worker's data
socket for sending: a record goes into the consumer's shared-memory ring when it has one
and the record fits, into a segment of its own when it is larger than the ring, and over
the socket otherwise (a remote consumer, a full ring). It counts what it sends for the
worker's heartbeat.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from zloader import _native, codec
from zloader._byfields import ByFields
from zloader.transport import messages, records
from zloader.transport.notice import FRAME_HEAD, NOTICE, frame_size, open_notify
from zloader.transport.protocol import encode
from zloader.transport.ring import RingError, RingWriter
from zloader.transport.shm import Segment, ShmError
from zloader.transport.sockets import NOBLOCK, send_frames

if TYPE_CHECKING:
    from zloader.worker.outgoing import Head

__all__ = ["Outlet", "Stream", "attach_ring", "unlink_handoffs"]

log = logging.getLogger("zloader.worker")

pack_into = _native.pick("pack_into", records.pack_into)
"""A record's buffers packed into a ring slot or segment: compiled where built
(zloader/_native.py)."""


@dataclass(eq=False, repr=False)
class Stream(ByFields):
    """One consumer reading this worker's task."""

    identity: bytes
    consumer: str
    epoch: int
    credits: int = 0
    # Its credits per mix input, when its job's consumers draw the mix (credit.py); None
    # otherwise.
    part_credits: list[int] | None = None
    ring: Any = None
    handoffs: dict[str, Any] = field(default_factory=dict)  # segments the consumer may map
    index: int | None = None  # consumer_index, in a coordinated job
    notify: int | None = None  # the consumer's notice pipe (transport/notice.py), if any
    ring_id: int | None = None  # the ring's id in the notices
    # (epoch, its records sent as DATA messages): a later record's notice says how many
    # came before it, for the consumer to keep their order (transport/notice.py).
    messages: tuple[int, int] = (-1, 0)
    # The epoch in which a framed record went as a DATA message (its notice found the
    # pipe full): no notice for the rest of it, since the ring's records must be taken in
    # the order they were written.
    unnoticed: int | None = None
    # The consumer's memory budget for this worker (OPEN.window, bytes; None: none), and
    # the sizes of the records sent and not yet given back by a CREDIT, oldest first.
    window: int | None = None
    flight: deque[int] = field(default_factory=deque)
    flight_bytes: int = 0
    # Credits the consumer gives back in the ring's header (OPEN.counter,
    # transport/ring.py): the OPEN number they are taken for (None: CREDIT messages
    # only), those taken since (mod 2**32), and the waits for them said there so far.
    counter: int | None = None
    counted: int = 0
    waits: int = 0

    def fits(self, size: int) -> bool:
        """Whether a record of ``size`` bytes may go now: within the window, or alone."""
        return self.window is None or not self.flight or self.flight_bytes + size <= self.window

    def sent(self, size: int) -> None:
        """A record of ``size`` bytes went to the consumer."""
        if self.window is not None:
            self.flight.append(size)
            self.flight_bytes += size

    def returned(self, records: int) -> None:
        """The consumer gave back ``records`` credits: its oldest records are used."""
        flight = self.flight
        for _ in range(min(records, len(flight))):
            self.flight_bytes -= flight.popleft()

    def attach(self, ring: str | None, ring_id: int | None,
               notify: str | None = None) -> None:
        """Write into the ring called ``ring`` from now on (None: none), announcing records
        on the consumer's pipe ``notify`` (kept when None) with ``ring_id``."""
        if self.ring is not None:
            self.ring.close()
        self.ring = attach_ring(ring) if ring is not None else None
        if notify is not None and self.notify is None:
            self.notify = open_notify(notify)
        self.ring_id = ring_id

    def close(self) -> None:
        """Unlink the segments handed to the consumer and detach from its ring."""
        unlink_handoffs(self)
        if self.ring is not None:
            self.ring.close()
        if self.notify is not None:
            os.close(self.notify)
            self.notify = None


class Outlet:
    """Sends to consumers on the worker's data socket, and counts what it sends.

    Args:
        data: the data socket (ROUTER).
        reject: how to report a consumer's ring that can no longer be used (the worker
            counts and logs it like a dropped message).
    """

    def __init__(self, data: zmq.Socket[Any], reject: Callable[[str], None]) -> None:
        self.data = data
        self.reject = reject
        self.elements = 0
        self.bytes = 0
        self.fallbacks = 0  # records a full ring sent over the socket
        self.sent = 0  # messages sent on the data socket (notices are not)

    def send(self, stream: Stream, record: messages.Record,
             payload: list[Any] | tuple[Any, ...] = ()) -> None:
        """Send one message (DATA, END, FAIL) to a consumer; a failure is logged, not
        raised. A DATA sent is counted: the stream's next notices say how many went
        before them (see :meth:`record`)."""
        self.sent += 1
        try:
            send_frames(self.data, [stream.identity, *encode(
                record.COMMAND, messages.encode(record), payload)], NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to consumer %s: %s", record.COMMAND.name,
                        stream.consumer, exc)
            return
        if type(record) is messages.Data:
            epoch, sent = stream.messages
            stream.messages = (record.epoch, sent + 1 if epoch == record.epoch else 1)

    def count(self, elements: int, nbytes: int) -> None:
        """Count a record sent (for the heartbeat's stats)."""
        self.elements += elements
        self.bytes += nbytes

    def record(self, stream: Stream, head: Head, frames: list[Any],
               sizes: list[int] | None = None) -> None:
        """Send one record (``head``: its epoch, count, skipped, and its origins, round
        and part; ``frames``: its codec buffers, then its origin block when
        ``head.origins``) as DATA. ``sizes``: the frames' sizes, when the caller found them
        already."""
        count, epoch = head.count, head.epoch
        fields: dict[str, Any] = {
            "epoch": epoch, "count": count, "skipped": head.skipped, "ring": None,
            "segment": None, "full": False, "shared": False, "lagged": None,
            "round": head.round, "origins": head.origins, "framed": False, "part": head.part,
            "first": head.first}
        if sizes is None:
            sizes = records.sizes_of(frames)
        self.count(count, sum(sizes))
        ring = stream.ring
        # A record keeps its place among its stream's: the consumer reads every notice
        # waiting before any message, and holds back one whose record says it follows
        # more DATA messages (a full ring, a segment) than have come.
        noticed = (stream.notify is not None and stream.ring_id is not None
                   and stream.unnoticed != epoch)
        if ring is not None:
            packed = records.packed_size(frames, sizes)
            if packed > ring.capacity and self._segment(stream, fields, frames, packed):
                return
            try:
                if noticed:
                    if self._framed(stream, ring, fields, frames, sizes, packed):
                        return
                    slot = None  # (the ring is full)
                else:
                    slot = ring.reserve(packed)
            except RingError as exc:  # its header was overwritten: sockets from now on
                self.reject(f"stopped using the ring of consumer {stream.consumer}: {exc}")
                ring.close()
                stream.ring = None
                slot = None
            if slot is not None:
                position, view = slot
                pack_into(frames, view, sizes)
                fields["ring"] = (position, packed, ring.name)
                self.send(stream, messages.Data.checked(fields))
                return
            self.fallbacks += 1
            fields["full"] = True  # the consumer may give this worker a larger ring
            if packed >= records.SEGMENT_BYTES and self._segment(stream, fields, frames,
                                                                 packed):
                return
        self.send(stream, messages.Data.checked(fields), codec.joined(frames))

    def _framed(self, stream: Stream, ring: RingWriter, fields: dict[str, Any],
                frames: list[Any], sizes: list[int], packed: int) -> bool:
        """Put the record in the ring framed (its DATA body in front of its buffers) and
        write its notice to the consumer's pipe (transport/notice.py); a notice that cannot
        be written goes as a DATA message naming the framed record. False: the ring has
        no room for it now.

        Raises:
            RingError: the ring's header is corrupt.
        """
        epoch, sent = stream.messages
        after = sent if sent and epoch == fields["epoch"] else None
        body = messages.Data.checked({**fields, "after": after}).to_body()
        start, length = frame_size(len(body), packed)
        slot = ring.reserve(length)
        if slot is None:
            return False
        position, view = slot
        FRAME_HEAD.pack_into(view, 0, len(body), 0)
        view[FRAME_HEAD.size:FRAME_HEAD.size + len(body)] = body
        pack_into(frames, view[start:], sizes)
        assert stream.notify is not None and stream.ring_id is not None
        try:
            os.write(stream.notify, NOTICE.pack(stream.ring_id, length, position))
        except OSError:  # the pipe is full (a stalled consumer) or gone: say it on the socket
            stream.unnoticed = fields["epoch"]
            self.send(stream, messages.Data.checked(
                {**fields, "ring": (position, length, ring.name), "framed": True}))
        return True

    def _segment(self, stream: Stream, fields: dict[str, Any], frames: list[Any],
                 packed: int) -> bool:
        """A record larger than the ring goes in a shared-memory segment of its own. This
        worker unlinks it once the consumer says it has mapped it (in CREDIT), or when the
        consumer goes away."""
        try:
            segment = Segment.create("big", packed)
        except (ShmError, OSError) as exc:
            log.warning("%s; sending the record over the socket", exc)
            return False
        pack_into(frames, segment.buf)
        stream.handoffs[segment.name] = segment
        self.send(stream, messages.Data.checked({**fields, "segment": (segment.name, packed)}))
        return True


def unlink_handoffs(stream: Stream, names: Any = None) -> None:
    """Unlink the segments handed to ``stream`` that it has mapped (``names``, from its
    CREDIT; unchecked), or all of them."""
    for name in list(stream.handoffs) if names is None else names:
        segment = stream.handoffs.pop(name, None) if isinstance(name, str) else None
        if segment is not None:
            segment.close()
            segment.unlink()


def attach_ring(name: str) -> Any:
    """The writer of a consumer's ring, or None to send over the socket instead."""
    try:
        return RingWriter(name)
    except FileNotFoundError:  # the consumer closed before this OPEN was read: not a fault
        log.debug("ring %s is gone: its consumer has left", name)
        return None
    except (OSError, ValueError) as exc:
        log.warning("cannot attach ring %s (%s): sending over the socket instead", name, exc)
        return None
