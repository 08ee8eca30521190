"""The broker's state machine, as plain calls with no sockets: :class:`State`.

Every handler takes the sender's routing identity (opaque bytes), the record of its
message (zloader/transport/messages.py: every field checked already) and the time,
updates the records (``records.py``), and returns the messages to send as :class:`Out`
tuples; the broker loop (``loop.py``) only moves bytes. :class:`State` holds
the tables and names each transition; the transitions themselves live in one module per
concern, each importing only those listed before it (docs/architecture.md):

- ``splits.py``: SPLIT_REQ, PASS_DONE, re-queued splits;
- ``coordinated.py``: ROUND_REQ, RECEIVED, COMMIT;
- ``views.py``: a job's view (JOB) and telling its consumers;
- ``failures.py``: workers that die, are stuck or move; fences (DELIVERED);
- ``placement.py``: which worker runs which job (the pool's policy is ``pool.py``);
- ``status.py``: heartbeats' views, STATUS, metrics, starvation samples;
- ``peers.py``: workers' READY, HEARTBEAT and LOG; consumers' HEARTBEAT;
- ``jobs.py``: REGISTER, EPOCH, BYE, TASK_FAILED, dropped consumers, collecting jobs
  (``tick``);
- ``history.py``: the journal's replay (``restore``) and ``snapshot``; every concern
  records its events through ``Tables.record`` (``records.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zloader._defaults import COMPACT_LINES
from zloader.broker import (
    coordinated,
    failures,
    history,
    jobs,
    peers,
    splits,
    status,
    views,
)
from zloader.broker.records import FENCE_GRACE, KILLS_TO_FAIL, Job, Out, Tables
from zloader.transport import messages
from zloader.transport.messages import (
    Delivered,
    Epoch,
    Heartbeat,
    Log,
    PassDone,
    Ready,
    Received,
    Register,
    RoundReq,
    SplitReq,
    TaskFailed,
    Weighed,
)

__all__ = ["FENCE_GRACE", "KILLS_TO_FAIL", "Out", "State"]


class State(Tables):
    """Workers, consumers, jobs, tasks and splits; see docs/protocol.md for the messages.

    Args:
        heartbeat: seconds between heartbeats.
        liveness: heartbeats a peer may miss before it is taken for dead.
        journal: record every change there, and :meth:`restore` from it; None: none.
        cooldown: the autoscaler's (``zloader/broker/autoscale.py``).
        limits: what peers may make it hold (``records.Limits``); None: the defaults.
    """

    # --- workers and consumers (peers.py) -------------------------------------------------

    def seen(self, identity: bytes, now: float) -> bool:
        """Note traffic from a peer; False when the peer is not registered."""
        return peers.seen(self, identity, now)

    def worker_ready(self, identity: bytes, msg: Ready, now: float) -> list[Out]:
        return peers.worker_ready(self, identity, msg, now)

    def worker_heartbeat(self, identity: bytes, msg: Heartbeat, now: float) -> list[Out]:
        return peers.worker_heartbeat(self, identity, msg, now)

    def worker_log(self, identity: bytes, msg: Log, now: float) -> list[Out]:
        return peers.worker_log(self, identity, msg, now)

    def consumer_heartbeat(self, identity: bytes, now: float,
                           msg: Heartbeat | None = None) -> list[Out]:
        return peers.consumer_heartbeat(self, identity, now, msg)

    # --- jobs (jobs.py) -------------------------------------------------------------------

    def register(self, identity: bytes, msg: Register, now: float) -> list[Out]:
        return jobs.register(self, identity, msg, now)

    def epoch_started(self, identity: bytes, msg: Epoch, now: float) -> list[Out]:
        return jobs.epoch_started(self, identity, msg, now)

    def bye(self, identity: bytes, now: float,
            left: dict[str, Any] | None = None) -> list[Out]:
        return jobs.bye(self, identity, now, left)

    def tick(self, now: float) -> list[Out]:
        """Purge silent peers, collect abandoned jobs, place workers (every heartbeat);
        compact the journal once it holds ``COMPACT_LINES`` lines."""
        out = jobs.tick(self, now)
        if self.journal is not None and self.journal.lines > COMPACT_LINES:
            self.journal.compact(self.snapshot())
        return out

    def task_failed(self, identity: bytes, msg: TaskFailed, now: float) -> list[Out]:
        return jobs.task_failed(self, identity, msg, now)

    # --- splits (splits.py) ---------------------------------------------------------------

    def split_request(self, identity: bytes, msg: SplitReq, now: float) -> list[Out]:
        return splits.split_request(self, identity, msg, now)

    def pass_done(self, identity: bytes, msg: PassDone, now: float) -> list[Out]:
        return splits.pass_done(self, identity, msg, now)

    def weighed(self, identity: bytes, msg: Weighed, now: float) -> list[Out]:
        return splits.weighed(self, identity, msg, now)

    # --- failures and fences (failures.py) ------------------------------------------------

    def delivered(self, identity: bytes, msg: Delivered, now: float) -> list[Out]:
        return failures.delivered(self, identity, msg, now)

    def stalled(self, seconds: float, now: float) -> None:
        """The broker itself did not run for ``seconds``: not held against its peers."""
        failures.stalled(self, seconds, now)

    # --- coordinated reads (coordinated.py) -----------------------------------------------

    def round_request(self, identity: bytes, msg: RoundReq, now: float) -> list[Out]:
        return coordinated.round_request(self, identity, msg, now)

    def rounds_received(self, identity: bytes, msg: Received, now: float) -> list[Out]:
        return coordinated.rounds_received(self, identity, msg, now)

    # --- the journal (history.py) ---------------------------------------------------------

    def restore(self, now: float) -> int:
        """Rebuild the state from the journal; returns the number of jobs restored."""
        return history.restore(self, now)

    def snapshot(self) -> list[dict[str, Any]]:
        """The journal lines that rebuild the state as it is now (for compaction)."""
        return [event.to_body() for event in history.snapshot(self)]

    def journal_errors(self) -> list[Out]:
        return history.journal_errors(self)

    # --- what the broker tells (status.py) ------------------------------------------------

    def job_view(self, job: Job) -> messages.Job:
        return views.job_view(self, job)

    def heartbeats(self) -> list[Out]:
        return status.heartbeats(self)

    def status(self, now: float, start: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return status.status(self, now, start)

    def note_actuator(self, entry: Any, now: float) -> None:
        status.note_actuator(self, entry, now)

    def metrics(self, now: float) -> dict[str, Any]:
        return status.metrics(self, now)
