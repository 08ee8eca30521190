"""Where a shared job's records live on the worker: one shared-memory segment per record.

Co-located trainers map the segment by name, copy-on-write (``Segment.attach(...,
private=True)``), so one copy of the record serves them all and a trainer that writes into
an element changes only its own pages. Remote trainers are sent the record from the same
memory. The worker unlinks a segment once the record has left the window and every trainer
it was sent to has confirmed mapping it (or has gone); the memory itself is freed when the
last mapping goes. Without room in ``/dev/shm`` a record is kept in private memory instead
and reaches co-located trainers over the socket.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from zloader.codec import joined
from zloader.transport import records
from zloader.transport.shm import Segment, ShmError

__all__ = ["Stored", "store"]

log = logging.getLogger("zloader.sharing")


@dataclass(eq=False)
class Stored:
    """One record's memory."""

    frames: list[Any]  # the codec buffers (views of the segment when there is one)
    length: int
    segment: Segment | None = None
    holders: set[bytes] = field(default_factory=set)  # sent, mapping not yet confirmed
    evicted: bool = False

    @property
    def name(self) -> str | None:
        return self.segment.name if self.segment is not None else None

    def free(self) -> None:
        """Unlink the segment (mappings stay valid until they are dropped)."""
        segment, self.segment = self.segment, None
        self.frames = []
        if segment is not None:
            segment.close()
            segment.unlink()

    @property
    def releasable(self) -> bool:
        return self.evicted and not self.holders


def store(buffers: list[Any]) -> Stored:
    """Copy a record's codec buffers into a new segment (or private memory)."""
    length = records.packed_size(buffers)
    try:
        segment = Segment.create("shr", length)
    except (ShmError, OSError) as exc:
        log.warning("%s; keeping a shared record in private memory", exc)
        return Stored([bytes(b) for b in joined(buffers)], length)
    records.pack_into(buffers, segment.buf)
    return Stored(records.unpack(segment.buf[:length]), length, segment)
