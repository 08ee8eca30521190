"""A consumer's link to the broker: REGISTER until the job's first view comes, heartbeats
(with what the end of the epoch has to report), the job's views (JOB), and registering
again when the broker forgot this consumer (UNKNOWN: it restarted, or gave up on it)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from zloader._byfields import ByFields
from zloader._defaults import BYE_LINGER_MS, SILENT_BROKER_REPEAT, SILENT_BROKER_WARNING
from zloader._host import host_id
from zloader.client.items import Failed, Item
from zloader.client.rounds import Rounds
from zloader.client.session import Session, Settings
from zloader.client.stats import Stats
from zloader.errors import PipelineError, ZloaderError
from zloader.forward import emit
from zloader.options import JobOptions
from zloader.transport import messages
from zloader.transport.protocol import ProtocolError, encode, error_from_object
from zloader.transport.sockets import make_socket

__all__ = ["BYE_LINGER_MS", "BrokerLink", "JobView", "registration"]

log = logging.getLogger("zloader.loader")


def registration(*, fingerprint: str, job_name: str | None, options: JobOptions,
                 consumer_index: int | None, source: dict[str, Any], inherited: bool,
                 resume: dict[str, Any] | None,
                 prefix: dict[str, Any] | None = None) -> messages.Register:
    """This consumer's REGISTER (docs/protocol.md), with a fresh consumer id: the job's
    ``options`` and what is this consumer's own (``consumer_index`` in a coordinated job,
    a resumed run's ``resume``, a shared job's pipeline's ``prefix``). ``inherited``: the
    workers have the pipeline already (forked from this process)."""
    return messages.Register(
        consumer=os.urandom(8).hex(), fingerprint=fingerprint, job_name=job_name,
        options=options, source=source, host_id=host_id(), pid=os.getpid(),
        consumer_index=consumer_index,
        pipeline={"inherited": True} if inherited else None,
        # (a deterministic Loader's state resumes here alone: only its entropy goes)
        resume=({"epoch": resume["epoch"], "delivered": resume["delivered"]}
                if resume is not None and "order" not in resume else None),
        entropy=resume["entropy"] if resume is not None else None,
        prefixes=tuple((prefix or {}).get("prefixes", ())),
        first_tap=(prefix or {}).get("first_tap", 1),
        stage_names=tuple((prefix or {}).get("stage_names", ())))


@dataclass(eq=False, repr=False)
class JobView(ByFields):
    """What a JOB message says beyond what the link keeps itself, for the peers and the
    end of the epoch (checked by its record, zloader/transport/messages.py)."""

    registered: bool  # the first view since (re-)registering
    workers: tuple[dict[str, Any], ...]  # the job's workers (JOB.workers)
    fences: tuple[dict[str, Any], ...]  # dead workers' fences this consumer may answer
    fencing: dict[str, Any]  # epoch -> fences holding it
    pending: dict[str, Any]  # epoch -> splits waiting to be read again
    consumers: int | None  # the job's consumer count
    read: list[Any] | None  # exactly-once: the splits handed out in the epoch (EPOCH's answer)
    drained: tuple[dict[str, Any], ...] = ()  # tasks that left the job cleanly (JOB.drained)


class BrokerLink:
    """The DEALER to the broker, in the consumer loop (whichever thread holds its turn).
    ``put`` hands the iterating thread an item (the job's errors). Reports for the next
    heartbeat queue in ``stuck`` and ``reread``; rounds received queue in ``acks``."""

    def __init__(self, settings: Settings, session: Session, stats: Stats,
                 register: messages.Register, blob: bytes, rounds: Rounds | None,
                 put: Callable[[Item], None]) -> None:
        self.settings = settings
        self.session = session
        self.stats = stats
        self.register = register  # sent until the job's first view comes
        self.blob = blob
        self.rounds = rounds
        self.put = put
        self.busy_elsewhere = 0  # the broker's workers serving other jobs (JOB view)
        self.stuck: list[dict[str, Any]] = []  # stuck workers to report
        self.reread: list[Any] = []  # splits to read again
        self.acks: list[int] = []  # rounds received
        self._reported_error = False
        self._reported_failures = 0
        self._unanswered: float | None = None  # since when REGISTER goes unanswered
        self._warned = 0.0  # when the last warning about that was logged
        self.socket: zmq.Socket[Any] | None = None

    def connect(self, context: zmq.Context[Any]) -> zmq.Socket[Any]:
        """Make the socket (in the thread that builds the loop) and connect it to the broker."""
        sock = make_socket(context, zmq.DEALER, self.settings.keys)
        sock.connect(self.settings.address)
        self.socket = sock
        return sock

    def send(self, record: messages.Record, payload: tuple[Any, ...] = ()) -> None:
        """Send the broker a message, unless it cannot take one now (not connected yet:
        the next heartbeat tries again)."""
        assert self.socket is not None
        with contextlib.suppress(zmq.Again):
            self.socket.send_multipart(encode(record.COMMAND, messages.encode(record),
                                              payload), zmq.NOBLOCK)

    def amend(self, **fields: Any) -> None:
        """Change fields of the REGISTER this consumer sends (``source_data``,
        ``pipeline``: where it serves them, once its socket is bound)."""
        self.register = dataclasses.replace(self.register, **fields)

    def beat(self) -> None:
        """Once a heartbeat: REGISTER until the job is known, then HEARTBEAT."""
        if self.session.job is None:
            self.send(self.register, (self.blob,))
            self._silence(time.monotonic())
        else:
            self._unanswered = None
            self.heartbeat()

    def _silence(self, now: float) -> None:
        """Warn while REGISTER goes unanswered: after ``SILENT_BROKER_WARNING`` seconds,
        then every ``SILENT_BROKER_REPEAT`` (nothing may listen at the address, or a broker
        there may be unreachable or refuse this consumer's keys)."""
        if self._unanswered is None:
            self._unanswered = self._warned = now
            return
        silent = now - self._unanswered
        due = SILENT_BROKER_WARNING if self._warned == self._unanswered else SILENT_BROKER_REPEAT
        if now - self._warned < due:
            return
        self._warned = now
        log.warning("no answer from a broker at %s for %.0f s: this Loader keeps sending its "
                    "REGISTER and raises zloader.Timeout after timeout=%g s (is "
                    "zloader-broker running there and reachable from this host, with the "
                    "keys this Loader uses? check the broker= address)",
                    self.settings.address, silent, self.settings.timeout)

    def heartbeat(self) -> None:
        """Send a HEARTBEAT now, with this consumer's stats and the queued reports."""
        stats = self.stats
        beat = messages.Heartbeat(stats={
            "elements": stats.yielded, "bytes": stats.bytes,
            "wait_seconds": round(stats.wait_seconds, 3), "skipped": stats.skipped,
            # reading an epoch not yet ended: the broker's pool counts this job as active
            "active": int(self.session.epoch is not None and not self.session.done)},
            stuck=tuple(self.stuck), reread=tuple(self.reread))
        self.stuck, self.reread = [], []
        self.send(beat)

    def ask_epoch(self) -> None:
        """EPOCH: tell the broker the epoch under way, or ask for its state."""
        self.send(messages.Epoch(job=self.session.job, epoch=self.session.epoch))

    def send_acks(self) -> None:
        """RECEIVED: the rounds received since the last call, if any."""
        if self.acks:
            assert self.session.epoch is not None  # rounds are received within an epoch
            self.send(messages.Received(epoch=self.session.epoch, rounds=tuple(self.acks)))
            self.acks = []

    def bye(self, left: dict[str, Any] | None = None) -> None:
        """Say goodbye and close, giving the BYE a moment to leave: the broker then
        releases the job at once, where a lost one costs the next job on its name or its
        workers an expiry's wait. ``left``: what was yielded of the epoch under way
        (``Bye.left``)."""
        assert self.socket is not None
        with contextlib.suppress(zmq.ZMQError):
            try:
                self.send(messages.Bye(left=left))
            except ProtocolError as exc:  # (what it yielded is too large to say)
                log.warning("could not say what this Loader yielded as it left (%s): a "
                            "worker death may repeat some of it to the job's other "
                            "Loaders", exc)
                self.send(messages.Bye())
        self.socket.close(linger=BYE_LINGER_MS)

    # --- what the broker says -------------------------------------------------------------

    def job(self, view: messages.Job) -> JobView:
        """Take in a JOB: the job's id and facts (into the session and the stats), its
        errors (handed on once each) and its rounds; return the rest."""
        session, stats = self.session, self.stats
        registered = session.job is None
        if registered:
            stats.last_progress = time.monotonic()
            stats.share = view.share
            stats.job_epoch = view.epoch if view.epoch is not None else 0
            session.branch = view.branch
            if self.rounds is not None:
                self.rounds.joined(view.joined, session.epoch)
        if self.rounds is not None:
            self.rounds.view(view.rounds, self.settings.address)
            stats.rounds_lost, stats.rounds_missed = self.rounds.total_lost, self.rounds.missed
        session.job = view.job
        if view.width:
            stats.width = view.width
        if view.heartbeat is not None:
            session.heartbeat = view.heartbeat
        self._errors(view)
        if view.entropy is not None:
            stats.entropy = view.entropy
        if view.stages is not None:
            stats.stages = {str(k): float(v) for k, v in view.stages.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.busy_elsewhere = view.busy_elsewhere
        return JobView(registered, view.workers, view.fences, view.fencing or {},
                       view.pending, view.consumers,
                       list(view.read) if view.read is not None else None, view.drained)

    def _errors(self, view: messages.Job) -> None:
        """Hand on the job's start-up error, and its latest failed split (before any
        the Done this JOB causes)."""
        if view.error and not self._reported_error:
            self._reported_error = True
            self.put(Failed(error_from_object(view.error, "worker start-up")))
        failed = view.failed
        if len(failed) > self._reported_failures:
            entry = failed[-1]
            self._reported_failures = len(failed)
            self.put(Failed(PipelineError.create(
                "worker", "RuntimeError", str(entry.get("message", "a split failed")),
                context=f"split {entry.get('split')}", builtin="RuntimeError")))

    def refused(self, refusal: messages.Error) -> None:
        """ERROR: the broker refused this consumer (a ValueError when about job_name)."""
        text = refusal.message
        error: Exception = ValueError(text) if "job_name" in text else ZloaderError(text)
        self.put(Failed(error))

    @staticmethod
    def log_lines(lines: messages.Log) -> None:
        """LOG: a remote worker's user output, into this process's log."""
        if lines.host is None or lines.pid is None:
            raise ProtocolError("LOG: the broker's LOG needs fields 'host' and 'pid'")
        emit(lines.host, lines.pid, [list(line) for line in lines.lines])

    def forgotten(self) -> None:
        """UNKNOWN: the broker restarted; register again on the next beat, for the same
        job if it has it."""
        if self.session.job is not None:
            self.amend(job=self.session.job)
        self.session.job = None
