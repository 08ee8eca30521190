"""The sliding window of a shared job on one worker: records produced once, one cursor per
trainer.

A worker serving a shared job puts every record it produces into its :class:`Window`, in
order, with a sequence number; each trainer reading from the worker has a :class:`Cursor`,
the sequence number of the next record to send it. The window keeps at most ``capacity``
bytes of records (always at least one). A record leaves the window from the old end once
every cursor has passed it; when room is needed before that, the ``lag`` policy decides:
``"skip"`` drops the oldest record anyway, and the cursors that had not passed it jump
forward (the elements they lose are counted on the cursor); ``"block"`` keeps it while the
producer waits, up to ``block_seconds`` per lagging trainer, then acts as ``"skip"`` for that
trainer until it takes a record again (:meth:`Window.took`): a trainer that stalls costs the
others ``block_seconds`` once, not per record.

An epoch's end is a record too (``end=True``, no data), so a cursor ends its epoch exactly
where the production of the epoch ended. A trainer that joins while an epoch is under way
starts at the oldest record of that epoch still in the window; what had already left the
window is its ``missed`` count, which the worker makes again for that trainer alone.

A job whose trainers share a prefix of their pipelines (docs/sharing.md) has one window per
worker for all of them: each record is of one ``branch`` (the trainers whose pipelines
are the same), and only that branch's cursors are sent it, hold it in the window, or
lose it to the lag policy; every branch counts in the one ``capacity``.

This module holds no sockets and no memory: the worker stores each record's data
(``Entry.data``) and acts on what these calls return.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from zloader._byfields import ByFields, FrozenByFields

__all__ = ["LAG_POLICIES", "Cursor", "Entry", "Window", "WindowSettings"]

LAG_POLICIES = ("block", "skip")


@dataclass(eq=False, repr=False)
class WindowSettings(FrozenByFields):
    """A shared job's window settings, as its TASK carries them (``share``)."""

    window_bytes: int
    lag: str
    block_seconds: float

    @classmethod
    def from_body(cls, share: dict[str, Any]) -> WindowSettings:
        """The settings in a TASK's ``share``.

        Raises:
            KeyError / TypeError / ValueError: one is missing or malformed.
        """
        settings = cls(int(share["window_bytes"]), str(share["lag"]),
                       float(share["block_seconds"]))
        _check_lag(settings.lag)
        return settings


def _check_lag(lag: str) -> None:
    if lag not in LAG_POLICIES:
        raise ValueError(f"share_lag must be one of {LAG_POLICIES}, got {lag!r}")


@dataclass(eq=False)
class Entry:
    """One record in the window."""

    seq: int
    epoch: int
    first: int  # index, in this worker's production of ``epoch``, of its first element
    count: int
    nbytes: int
    end: bool = False
    data: Any = None
    skipped: int = 0  # elements dropped by on_error="skip" so far in the epoch
    branch: int = 0  # whose trainers' record it is (an epoch's end: every branch's)

    def of(self, cursor: Cursor) -> bool:
        """Whether ``cursor``'s trainer is sent this entry (its branch's, or an end)."""
        return self.end or self.branch == cursor.branch


@dataclass(eq=False)
class Cursor:
    """One trainer's place in the window."""

    trainer: bytes
    epoch: int
    seq: int
    missed: int = 0  # elements of ``epoch`` that left the window before the trainer came
    lagged: int = 0  # elements lost to the lag policy (never sent to this trainer)
    # when the producer began waiting for it ("block"); None again once it takes a record
    waiting_since: float | None = None
    done: bool = False  # its epoch has ended for it
    credits: int = 0  # records it may be sent
    end: Entry | None = None  # its epoch's end, when that left the window before it got there
    replaying: bool = False  # its missed elements are being made again for it
    branch: int = 0  # the records it is sent (those of the trainers with its pipeline)


@dataclass(eq=False, repr=False)
class Window(ByFields):
    """A worker's window of a shared job: the records it keeps (``capacity`` bytes) for
    trainers that lag, each trainer's cursor, and what a full window does (``lag``)."""

    capacity: int
    lag: str = "block"
    block_seconds: float = 10.0
    entries: deque[Entry] = field(default_factory=deque)
    cursors: dict[bytes, Cursor] = field(default_factory=dict)
    head: int = 0  # sequence number of the next record
    nbytes: int = 0
    # (epoch, branch) -> elements produced
    produced: dict[tuple[int, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_lag(self.lag)

    # --- producing ------------------------------------------------------------------------

    def room(self, nbytes: int, now: float) -> tuple[bool, list[Entry]]:
        """Make room for a record of ``nbytes``. Returns whether it may be added now, and
        the entries that left the window (the caller frees their data)."""
        gone: list[Entry] = []
        while self.entries and self.nbytes + nbytes > self.capacity:
            oldest = self.entries[0]
            behind = [c for c in self.cursors.values()
                      if c.seq <= oldest.seq and oldest.of(c)]
            if behind and self.lag == "block":
                for cursor in behind:
                    if cursor.waiting_since is None:
                        cursor.waiting_since = now
                if any(now - c.waiting_since < self.block_seconds  # type: ignore[operator]
                       for c in behind):
                    return False, gone
            for cursor in behind:  # "skip" (or blocked too long): they lose this record
                if oldest.end and oldest.epoch == cursor.epoch and not cursor.done:
                    cursor.end = oldest
                elif oldest.epoch >= cursor.epoch:
                    cursor.lagged += oldest.count
                cursor.seq = oldest.seq + 1
            for cursor in self.cursors.values():  # (other branches': not theirs to lose)
                cursor.seq = max(cursor.seq, oldest.seq + 1)
            gone.append(self._pop())
        return True, gone

    def add(self, epoch: int, count: int, nbytes: int, data: Any = None, *,
            end: bool = False, skipped: int = 0, branch: int = 0) -> Entry:
        """Append a record of ``branch`` (call :meth:`room` first)."""
        first = self.produced.get((epoch, branch), 0)
        entry = Entry(self.head, epoch, first, count, nbytes, end, data, skipped, branch)
        self.produced[epoch, branch] = first + count
        self.head += 1
        self.nbytes += nbytes
        self.entries.append(entry)
        return entry

    def _pop(self) -> Entry:
        entry = self.entries.popleft()
        self.nbytes -= entry.nbytes
        return entry

    def clear(self) -> list[Entry]:
        gone = list(self.entries)
        self.entries.clear()
        self.nbytes = 0
        return gone

    # --- trainers -------------------------------------------------------------------------

    def join(self, trainer: bytes, epoch: int, started: bool,
             finished: bool = False, branch: int = 0, unmade: int | None = None) -> Cursor:
        """A trainer of ``branch`` starts reading ``epoch`` here (a new trainer, or one
        that finished its previous epoch). ``started``: this worker has begun producing
        ``epoch``; ``finished``: it has produced all of it; ``unmade``: the branch is not
        made in this production of the epoch (it came after it began): its ``missed``
        (all of the epoch, made again for it alone)."""
        cursor = self.cursors.get(trainer)
        if cursor is not None and cursor.epoch < epoch and not started:
            cursor.epoch, cursor.done, cursor.missed, cursor.end = epoch, False, 0, None
            cursor.seq, cursor.branch = min(cursor.seq, self.head), branch
            return cursor
        ours = next((e for e in self.entries if e.epoch == epoch and not e.end
                     and e.branch == branch), None)
        if ours is None:  # (no record of its branch: its end, if any, is where it starts)
            ours = next((e for e in self.entries if e.epoch == epoch and e.end), None)
        if not started:
            seq, missed = self.head, 0
        elif unmade is not None:
            seq, missed = ours.seq if ours is not None else self.head, unmade
        elif ours is not None:
            seq, missed = ours.seq, ours.first if not ours.end \
                else self.produced.get((epoch, branch), 0)
        else:  # the epoch was produced and has left the window: all of it is missed
            seq, missed = self.head, self.produced.get((epoch, branch), 0)
        if cursor is None:
            cursor = self.cursors[trainer] = Cursor(trainer, epoch, seq, missed,
                                                    branch=branch)
        else:
            cursor.epoch, cursor.seq, cursor.missed, cursor.done = epoch, seq, missed, False
            cursor.end, cursor.replaying, cursor.branch = None, False, branch
        if finished and not any(e.epoch == epoch and e.end for e in self.entries):
            # its end has left the window too: it is over here
            cursor.end = Entry(seq - 1, epoch, missed, 0, 0, end=True)
        return cursor

    @staticmethod
    def took(cursor: Cursor, entry: Entry) -> None:
        """The trainer was sent ``entry``: it moves, so the producer may wait for it
        again."""
        cursor.seq = max(cursor.seq, entry.seq + 1)
        cursor.waiting_since = None

    def resume(self, cursor: Cursor, had: int) -> int:
        """A trainer that had ``had`` elements of its epoch from here, in the order they
        were made, joins it again (this worker had forgotten it: its grace ran out): its
        cursor skips the records it had that are still in the window. Returns how many of
        the missed elements it had (those a replay leaves out); when it had them all, its
        ``missed`` is 0 (nothing is made again for it)."""
        if had < cursor.missed:
            return had
        base = self.entries[0].seq if self.entries else self.head
        for index in range(max(0, cursor.seq - base), len(self.entries)):
            entry = self.entries[index]
            if entry.epoch == cursor.epoch and not entry.end and entry.first < had \
                    and entry.branch == cursor.branch:
                cursor.seq = entry.seq + 1
        cursor.missed = 0
        return 0

    def leave(self, trainer: bytes) -> Cursor | None:
        return self.cursors.pop(trainer, None)

    def next_for(self, cursor: Cursor) -> Entry | None:
        """The next entry of the cursor's epoch and branch (skipping others' entries), or
        None when it has to wait for production."""
        if not self.entries:
            return None
        base = self.entries[0].seq
        cursor.seq = max(cursor.seq, base)  # behind only by eviction: counted there
        for index in range(cursor.seq - base, len(self.entries)):
            entry = self.entries[index]
            if entry.epoch == cursor.epoch and entry.of(cursor):
                return entry
            cursor.seq = entry.seq + 1
        return None

    def unsent(self) -> bool:
        """Whether a trainer still reading its epoch has records of it in the window that
        were not sent to it yet (production follows the fastest trainer: a slower one
        lags behind it)."""
        return any(entry.seq >= cursor.seq and entry.epoch == cursor.epoch and entry.of(cursor)
                   for cursor in self.cursors.values() if not cursor.done
                   for entry in self.entries)

    def lead(self, epoch: int) -> int:
        """How many records past the head the trainers reading ``epoch`` could take now
        (their cursor plus their credits)."""
        wanted = [c.seq + c.credits for c in self.cursors.values()
                  if c.epoch == epoch and not c.done]
        return max(wanted, default=self.head) - self.head
