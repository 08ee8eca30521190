"""What a producer hands on to its worker's delivery: a record (:class:`Outgoing`, with its
:class:`Head`) and the end of its epoch (:class:`EndOut`), typed both ways (the producer's
thread makes them, the worker's delivery modes read them)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from zloader import codec
from zloader._byfields import ByFields, FrozenByFields

__all__ = ["EndOut", "Head", "Outgoing", "weigh"]


@dataclass(eq=False, repr=False, slots=True)
class Head(ByFields):
    """A record's head: the epoch it is of, its elements, the elements skipped so far in
    the epoch (``on_error="skip"``), whether its last buffer is an origin block
    (exactly-once), the stream it belongs to (``part``: a mix input its consumers draw, a
    deterministic job's shard; None), in a coordinated job its round (set when it is
    sent), and in a shared job its ``branch`` (the trainers it is for: 0, or those of a
    pipeline that shares a prefix with the job's, zloader/sharing/branches.py)."""

    epoch: int
    count: int
    skipped: int = 0
    origins: bool = False
    part: int | None = None
    round: int | None = None
    branch: int = 0
    first: int | None = None  # a shared job's: its place in the epoch (DATA.first)


@dataclass(eq=False, repr=False)
class EndOut(FrozenByFields):
    """The producer finished ``epoch`` here (its END): the elements it skipped and
    dropped, and the origins block of what no record carried (exactly-once; None); with a
    ``part``, not the epoch's end but that of a mix input its consumers draw."""

    epoch: int
    skipped: int = 0
    dropped: int = 0
    origins: Any = None
    part: int | None = None


@dataclass(eq=False)
class Outgoing:
    """One record on its way to the socket thread: its :class:`Head` and its codec
    buffers. When ``gathered`` (it references rows user code may overwrite next) or
    ``large`` (at least ``LARGE_RECORD_BYTES``), the producer waits for ``taken``, set by
    :meth:`mark_taken` once the buffers have been copied out, sent or dropped (or, for a
    large one, kept by a delivery that holds records: rounds). Other records have no event
    (one per record would cost a lock and a condition each)."""

    head: Head
    buffers: list[Any]
    gathered: bool
    large: bool = False
    taken: threading.Event | None = None

    @property
    def epoch(self) -> int:
        return self.head.epoch

    def __post_init__(self) -> None:
        if (self.gathered or self.large) and self.taken is None:
            self.taken = threading.Event()

    def mark_taken(self) -> None:
        """The buffers were copied out, or dropped: the producer may go on."""
        if self.taken is not None:
            self.taken.set()


def weigh(element: Any, depth: int = 0) -> tuple[int, bool]:
    """About how many bytes ``element`` holds, and whether it holds a ``codec.Stacked``
    (whose rows user code may overwrite next: its record is sent at once)."""
    if type(element) is codec.Stacked:
        return element.nbytes, True
    try:
        nbytes = getattr(element, "nbytes", None)
    except Exception:  # (a sparse tensor's nbytes raises: weighed as its parts below)
        nbytes = None
    if isinstance(nbytes, int):
        return nbytes, False
    if isinstance(element, (bytes, str)):
        return len(element), False
    # Every level of a structure (few items) is looked at; long sequences only near the top.
    values: Any = ()
    if isinstance(element, dict):
        values = element.values()
    elif isinstance(element, (list, tuple)):
        values = element
    if not values or depth >= codec.MAX_DEPTH or (depth >= 3 and len(values) > 16):
        return 8, False
    total, gathered = 0, False
    for value in values:
        size, stacked = weigh(value, depth + 1)
        total, gathered = total + size, gathered or stacked
    return total, gathered
