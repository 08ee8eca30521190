"""The one record both of a Loader's threads read: :class:`Stats`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from zloader._byfields import ByFields

__all__ = ["Stats"]


@dataclass(eq=False, repr=False)
class Stats(ByFields):
    """A consumer's counters and what it knows of its job.

    Each field has one writer, named first in its comment: ``loop``, the consumer loop
    (client/loop.py and the parts it calls: link, peers, receive, epoch_end), which
    whichever thread holds the loop's turn steps, one thread at a time (client/turn.py);
    ``iterating``, the thread that iterates the Loader (client/merging.py). The other thread
    only reads a field (the loop sends the iterating thread's in heartbeats, for the
    broker's metrics), a value at most one step old: no lock is needed.
    """

    bytes: int = 0  # loop: of records received
    records: int = 0  # loop
    private: int = 0  # loop: records that bypassed a full ring
    segments: int = 0  # loop: records too large for the ring, sent in a segment of their own
    held: int = 0  # loop: records whose notice came before an earlier record's DATA message
    skipped: int = 0  # loop: elements the workers dropped (on_error="skip") this epoch
    per_worker: dict[int, int] = field(default_factory=dict)  # loop: elements by worker pid
    lagged: int = 0  # loop: a shared job's elements this trainer lost to the lag policy
    replayed: int = 0  # loop: ... and the elements made again for it (it joined late)
    dropped: int = 0  # loop: elements dropped to keep rounds whole (coordinated reads)
    rejected: int = 0  # loop: corrupt records and malformed messages dropped (logged)
    rounds_lost: int = 0  # loop: the job's rounds lost so far (coordinated reads)
    rounds_missed: int = 0  # loop: rounds this consumer passed over when it (re)joined
    last_progress: float = field(default_factory=time.monotonic)  # loop: when data last came
    was_doing: dict[int, str] = field(default_factory=dict)  # loop: pid -> what a worker that
    # left the job did
    # (the job, as the broker last described it)
    stages: dict[str, float] = field(default_factory=dict)  # loop: its workers' seconds by stage
    job_epoch: int | None = None  # loop: its epoch when this consumer joined; None until it did
    entropy: int | None = None  # loop: its random entropy, once known
    share: dict[str, object] | None = None  # loop: a shared job's window settings
    width: int = 1  # loop: its worker indices
    indices: tuple[int, ...] = ()  # loop: those of the workers that serve it now
    yielded: int = 0  # iterating: elements
    wait_seconds: float = 0.0  # iterating: waiting for data
