"""The broker's state and its transitions, as plain calls with no sockets.

Every handler takes the sender's routing identity (opaque bytes), the message body and the
time, updates the records below, and returns the messages to send as :class:`Out` tuples;
the broker loop (``zloader/broker.py``) only moves bytes. Nothing here imports zmq or runs
user code: pipelines are kept as opaque blobs.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from zloader import pool
from zloader._defaults import HUNGRY_STARVATION, STAGES
from zloader._host import loopback
from zloader.autoscale import Autoscaler
from zloader.forward import BURST, RATE, Bucket, valid_lines
from zloader.journal import COMPACT_LINES, Journal
from zloader.lineage import Ledger, merge_info, pack
from zloader.rounds import Rounds
from zloader.sharing.options import KEY_OPTIONS
from zloader.sharing.window import LAG_POLICIES
from zloader.sources import split_order
from zloader.transport.protocol import Command, Message, ProtocolError, doing

__all__ = ["KILLS_TO_FAIL", "Out", "State"]

log = logging.getLogger("zloader.broker")

KILLS_TO_FAIL = 3
"""A split that was being read by a dying worker this many times is reported, not re-run."""
SHARDING_MODES = ("dynamic", "static", "off")
FENCE_GRACE = 10
"""Expiries (``liveness`` heartbeats each) a fence waits for a consumer that went silent: a
stalled consumer that comes back still answers, so what it holds is not read again."""


class Out(NamedTuple):
    """One message to send: to ``identity``, ``command`` with ``body`` and ``payload``."""

    identity: bytes
    command: Command
    body: dict[str, Any]
    payload: tuple[Any, ...] = ()


@dataclass
class Worker:
    id: str
    identity: bytes
    host: str
    host_id: str
    pid: int
    endpoint: str
    prefer: str | None
    last_seen: float
    task: str | None = None
    current: tuple[tuple[int, ...], int] | None = None  # (pass, split) being read
    stats: dict[str, Any] = field(default_factory=dict)
    rate: float = 0.0
    trainers: dict[str, dict[str, int]] = field(default_factory=dict)  # shared job: lag
    plain_data: bool = False  # its data socket speaks PLAIN, not CURVE (--plain-data)
    idle_since: float = 0.0  # when it last had no task (surplus marks, see State.status)
    doing: dict[str, Any] | None = None  # its producer's {epoch, split, stage} (heartbeat)
    holds: frozenset[str] = frozenset()  # fingerprints of pipelines it inherited by fork
    since: float = 0.0  # when it took its task (the pool's time slices, zloader/pool.py)
    # LOG lines it may send: twice what its own limit lets through (zloader/forward.py)
    log_budget: Bucket = field(default_factory=lambda: Bucket(2 * RATE, 4.0 * BURST))


@dataclass
class Consumer:
    id: str
    identity: bytes
    job: str
    host_id: str
    pid: int
    last_seen: float
    stats: dict[str, Any] = field(default_factory=dict)  # from its heartbeats
    active: bool = True  # it reads an epoch not yet ended (HEARTBEAT stats.active)


@dataclass
class Pass:
    order: deque[int]
    handed: dict[str, list[int]] = field(default_factory=dict)
    requeued: deque[int] = field(default_factory=deque)
    # Exactly-once jobs: splits a worker finished reading whose elements it may still hold
    # (a shuffle buffer, a batch), and what to skip when a split of this pass is read again.
    read: dict[str, list[int]] = field(default_factory=dict)
    skips: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Fence:
    """A dead worker's splits of an exactly-once job, held until every consumer has said
    which of their elements it holds (it has stopped reading from that worker first)."""

    worker: str
    task: str | None
    died: bool
    splits: list[tuple[tuple[int, ...], int]]  # (pass, split)
    waiting: set[str]  # consumers yet to answer
    deadline: float  # then the silent ones are given up
    replies: dict[tuple[tuple[int, ...], int], dict[str, Any]] = field(default_factory=dict)
    event: dict[str, Any] = field(default_factory=dict)  # journaled once it is done


@dataclass
class Job:
    id: str
    fingerprint: str
    name: str | None
    sharding: str
    deterministic: bool
    on_error: str
    options: dict[str, Any]
    blob: bytes
    num_splits: int
    shuffle_splits: bool
    seed: int | None
    width: int  # static sharding: the fixed number of worker indices
    source_data: dict[str, Any] | None
    entropy: int
    created: float
    tasks: dict[str, str] = field(default_factory=dict)       # task id -> worker id
    indices: dict[str, int] = field(default_factory=dict)     # task id -> worker index
    consumers: set[str] = field(default_factory=set)
    passes: dict[tuple[int, ...], Pass] = field(default_factory=dict)
    kills: dict[int, int] = field(default_factory=dict)
    failed: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None
    idle_since: float | None = None
    linger: float = 0.0  # seconds a job without consumers is kept (more if they went silent)
    elements: int = 0
    bytes: int = 0
    share: dict[str, Any] | None = None  # window settings of a shared job
    epoch: int = 0  # the highest epoch a consumer has started
    rounds: Rounds | None = None  # coordinated reads (num_consumers)
    requeues: dict[int, int] = field(default_factory=dict)  # epoch -> splits re-queued
    track: bool = False  # exactly-once: elements carry origins (zloader/lineage.py)
    fences: dict[str, Fence] = field(default_factory=dict)
    silent: dict[str, float] = field(default_factory=dict)  # consumer -> when it expired
    origin_of: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = field(
        default_factory=dict)  # (pass, split) -> the pass a re-queued split belongs to
    resume: tuple[int, Any] | None = None  # (epoch, Ledger) a resumed Loader delivered
    wait_seconds: float = 0.0  # consumers' time waiting for data, summed (metrics)
    skipped: int = 0
    starvation: float = 0.0  # share of the last interval the consumers waited
    waited_at: tuple[float, float] | None = None  # (wait_seconds, time) at the last sample
    stages: dict[str, float] = field(default_factory=dict)  # workers' seconds, by stage
    scaler: Autoscaler = field(default_factory=Autoscaler)  # desired_workers (dynamic jobs)
    desired: int = 0
    pipeline: dict[str, Any] | None = None  # where workers get a pipeline not in ``blob``
    hungry_until: float = 0.0  # an epoch just started: hungry before its first sample

    @property
    def weight(self) -> float:
        """Its share of the pool relative to other jobs' (``Loader(weight=)``)."""
        return float(self.options.get("weight", 1.0))


class State:
    """Workers, consumers, jobs, tasks and splits; see docs/protocol.md for the messages."""

    def __init__(self, heartbeat: float = 1.0, liveness: int = 3,
                 journal: Journal | None = None, cooldown: float = 30.0) -> None:
        self.heartbeat = heartbeat
        self.cooldown = cooldown  # the autoscaler's (zloader/autoscale.py)
        self.liveness = liveness
        self.journal = journal
        self.workers: dict[str, Worker] = {}
        self.consumers: dict[str, Consumer] = {}
        self.jobs: dict[str, Job] = {}
        self.peers: dict[bytes, tuple[str, str]] = {}  # identity -> ("worker"|"consumer", id)
        self.rejected = 0  # malformed or refused messages dropped (the broker counts them)
        self._unjournaled: set[str] = set()  # jobs whose journal writes failed
        self._told: set[str] = set()  # consumers told so (journal_errors)

    # --- peers ----------------------------------------------------------------------------

    @property
    def expiry(self) -> float:
        return self.heartbeat * self.liveness

    def seen(self, identity: bytes, now: float) -> bool:
        """Note traffic from a peer; False when the peer is not registered."""
        kind, pid = self.peers.get(identity, ("", ""))
        record: Worker | Consumer | None = (self.workers.get(pid) if kind == "worker"
                                            else self.consumers.get(pid))
        if record is None:
            return False
        record.last_seen = now
        return True

    def worker_ready(self, identity: bytes, msg: Message, now: float) -> list[Out]:
        worker_id = msg.field("worker", str)
        old = self.workers.get(worker_id)
        if old is not None:  # a reconnect: keep its task, take the new identity
            self.peers.pop(old.identity, None)
            old.identity, old.last_seen = identity, now
            self.peers[identity] = ("worker", worker_id)
            out = [Out(identity, Command.ACK, {"heartbeat": self.heartbeat,
                                               "task": old.task})]
            job = self.jobs.get(self._task_job(old.task) or "")
            if job is not None and job.rounds is not None:
                # Round numbers sent to its old connection may be lost: it asks again.
                out += self._announce(job, {}, job.rounds.lose_worker(worker_id))
            return out
        endpoint = msg.field("endpoint", str)
        if not endpoint.startswith(("tcp://", "ipc://")) or len(endpoint) > 1024:
            raise ProtocolError(f"READY: endpoint must be tcp://HOST:PORT or ipc://PATH, got "
                                f"{endpoint[:80]!r}")
        worker = Worker(worker_id, identity, msg.field("host", str), msg.field("host_id", str),
                        msg.field("pid", int), endpoint,
                        msg.field("prefer", str, optional=True), now,
                        plain_data=msg.body.get("plain_data") is True, idle_since=now,
                        holds=_holds(msg.body.get("holds")))
        self.workers[worker_id] = worker
        self._record(_worker_event(worker))
        self.peers[identity] = ("worker", worker_id)
        # "task": None tells a worker the broker had forgotten that it must drop the task
        # it still runs (its splits went to others): nothing it still holds may reach a
        # consumer.
        return [Out(identity, Command.ACK, {"heartbeat": self.heartbeat, "task": None}),
                *self._assign(now)]

    def worker_heartbeat(self, identity: bytes, msg: Message, now: float) -> None:
        worker = self._worker(identity)
        stats = msg.body.get("stats")
        if worker is None or not isinstance(stats, dict):
            return
        elements = stats.get("elements")
        before = worker.stats.get("elements")
        if isinstance(elements, int) and isinstance(before, int):
            elapsed = now - worker.stats.get("_at", now)
            if elapsed > 0:
                worker.rate = (elements - before) / elapsed
        job = self.jobs.get(self._task_job(worker.task) or "")
        if job is not None:
            job.elements += _delta(stats, worker.stats, "elements")
            job.bytes += _delta(stats, worker.stats, "bytes")
            for stage in STAGES:
                job.stages[stage] = job.stages.get(stage, 0.0) + _delta(
                    stats, worker.stats, f"{stage}_seconds")
        worker.stats = {**{k: v for k, v in stats.items() if isinstance(v, (int, float))},
                        "_at": now}
        worker.doing = doing(msg.body.get("doing"))
        trainers = stats.get("trainers")
        worker.trainers = {
            str(c): {k: int(v[k]) for k in ("lag", "skipped") if isinstance(v.get(k), int)}
            for c, v in trainers.items() if isinstance(v, dict)
        } if isinstance(trainers, dict) else {}

    def worker_log(self, identity: bytes, msg: Message, now: float) -> list[Out]:
        """Pass what user code printed or logged on a worker to its job's consumers
        (zloader/forward.py); lines of a task the worker no longer runs are dropped."""
        worker = self._worker(identity)
        lines = valid_lines(msg.body.get("lines"))
        if lines is None:
            raise ProtocolError("LOG: lines must be a list of at most 500 [level, text] pairs")
        if worker is None or worker.task is None or msg.field("task", str) != worker.task:
            return []
        if len(lines) > worker.log_budget.fill(now):  # not one of our workers: dropped
            self.rejected += 1
            return []
        worker.log_budget.tokens -= len(lines)
        job = self.jobs.get(self._task_job(worker.task) or "")
        if job is None:
            return []
        body = {"host": worker.host, "pid": worker.pid, "lines": lines}
        return [Out(c.identity, Command.LOG, body) for cid in job.consumers
                if (c := self.consumers.get(cid)) is not None]

    # --- consumers and jobs ---------------------------------------------------------------

    def register(self, identity: bytes, msg: Message, now: float) -> list[Out]:
        consumer_id = msg.field("consumer", str)
        fingerprint = msg.field("fingerprint", str)
        name = msg.field("job_name", str, optional=True)
        sharding = msg.field("sharding", str)
        if sharding not in SHARDING_MODES:
            raise ProtocolError(f"REGISTER: unknown sharding {sharding!r}")
        if not msg.payload:
            raise ProtocolError("REGISTER: missing the pipeline payload")
        source = msg.field("source", dict)
        options = {"sharding": sharding,
                   "deterministic": bool(msg.body.get("deterministic", False)),
                   "on_error": str(msg.body.get("on_error", "raise")),
                   "num_workers": msg.field("num_workers", int),
                   "balanced": _count(msg.body.get("balanced", 0)),
                   "weight": _weight(msg.body.get("weight", 1.0))}
        share = _share(msg.body.get("share"))
        if share is not None and name:
            raise ProtocolError("REGISTER: a shared job cannot have a job_name")
        coordinated = _coordinated(msg.body.get("coordinated"), name)
        options["num_consumers"] = coordinated[0] if coordinated else 0
        options["exactly_once"] = (msg.body.get("exactly_once") is True
                                   and sharding == "dynamic" and share is None
                                   and not options["deterministic"] and not coordinated
                                   and not options["balanced"])
        job = self._named_job(name) if name else None
        previous = self.jobs.get(str(msg.body.get("job")))  # it registers again (a restart)
        known = self.consumers.get(consumer_id)
        if previous is None and known is not None:
            # A REGISTER repeated while the answer was on its way (those a Loader queued
            # before the broker was up arrive together): the same consumer, the same job.
            previous = self.jobs.get(known.job)
        if previous is not None and previous.fingerprint == fingerprint \
                and previous.error is None:
            job = previous
        elif share is not None:
            job = next((j for j in self.jobs.values() if j.share is not None and j.error is None
                        and j.fingerprint == fingerprint
                        and all(j.options[k] == options[k] for k in KEY_OPTIONS)), None)
            if job is None:
                job = self._new_job(msg, fingerprint, None, options, source, now)
                job.share = share
                self._record({"e": "share", "job": job.id, "share": share})
        elif job is not None:
            mismatch = self._mismatch(job, fingerprint, options)
            if mismatch and not job.consumers and job.idle_since is not None:
                remaining = max(self.expiry, job.linger) - (now - job.idle_since)
                mismatch += (f" (its consumers went silent: it is kept for them "
                             f"{max(0.0, remaining):.0f} s more, then released)")
            if mismatch:
                return [Out(identity, Command.ERROR, {"message": mismatch})]
        else:
            job = self._new_job(msg, fingerprint, name, options, source, now)
            self._resume(job, msg.body.get("resume"))
            if coordinated:
                job.rounds = Rounds(coordinated[0])
                self._record({"e": "rounds", "job": job.id, "size": coordinated[0]})
        out: list[Out] = []
        joined: dict[str, int] | None = None
        if job.rounds is not None and coordinated:
            why = job.rounds.replaced.get(consumer_id)
            if why:
                return [Out(identity, Command.ERROR, {"message": why})]
            holder = job.rounds.members.get(coordinated[1])
            if holder is not None and holder != consumer_id:
                out += self._replace(job, holder, coordinated[1], msg, now)
            joined = job.rounds.join(consumer_id, coordinated[1], job.epoch)
        old = self.consumers.get(consumer_id)
        if old is not None:
            self.peers.pop(old.identity, None)
            left = self.jobs.get(old.job)
            if left is not None and left is not job:  # it moved: no ghost in the old job
                left.consumers.discard(consumer_id)
                if not left.consumers:
                    left.idle_since = now
        self.consumers[consumer_id] = Consumer(consumer_id, identity, job.id,
                                               msg.field("host_id", str), msg.field("pid", int),
                                               now)
        self.peers[identity] = ("consumer", consumer_id)
        job.consumers.add(consumer_id)
        job.silent.pop(consumer_id, None)
        job.idle_since = None
        # The answer comes last and is the only JOB this consumer gets now (a consumer reads
        # ``joined`` from its first JOB); job views must reach a consumer in order.
        assigned = [o for o in self._assign(now)
                    if o.identity != identity or o.command is not Command.JOB]
        view = self.job_view(job)
        if joined is not None:
            view["joined"] = joined
        return [*out, *assigned, Out(identity, Command.JOB, view)]

    def _resume(self, job: Job, value: Any) -> None:
        """A resumed Loader's ``{"epoch", "delivered"}`` (``Loader.state_dict()``): the
        epoch's splits hand out only what it had not yielded."""
        if value is None:
            return
        if not (isinstance(value, dict) and isinstance(value.get("epoch"), int)
                and value["epoch"] >= 0):
            raise ProtocolError("REGISTER: resume must be {epoch, delivered}")
        if not job.track:
            raise ProtocolError("REGISTER: resume needs an exactly-once job (dynamic "
                                "sharding, no share, balanced or num_consumers)")
        ledger = Ledger()
        try:
            ledger.merge_json(value.get("delivered"))
        except ValueError as exc:
            raise ProtocolError(f"REGISTER: resume: {exc}") from None
        job.resume = (value["epoch"], ledger)
        job.epoch = max(job.epoch, value["epoch"])
        self._record({"e": "resume", "job": job.id, "epoch": value["epoch"],
                      "delivered": ledger.to_json()})

    def _replace(self, job: Job, holder: str, index: int, msg: Message,
                 now: float) -> list[Out]:
        """A restarted consumer takes over ``index`` from ``holder``, which is dropped and,
        should it still be alive, refused from now on."""
        assert job.rounds is not None
        old = self.consumers.get(holder)
        where = f"pid {old.pid}" if old is not None else "an earlier consumer"
        job.rounds.replaced[holder] = (
            f"consumer_index {index} of job_name {job.name!r} was taken over by another "
            f"consumer (pid {msg.body.get('pid')}), as a restarted consumer does; if this "
            f"one ({where}) is still meant to run, two consumers were given the same "
            "consumer_index")
        return [Out(o.identity, o.command, {**o.body, "replaced": True}, o.payload)
                if o.command is Command.CONSUMER_GONE else o
                for o in self._drop_consumer(holder, now)]

    def _named_job(self, name: str) -> Job | None:
        return next((j for j in self.jobs.values() if j.name == name), None)

    def _mismatch(self, job: Job, fingerprint: str, options: dict[str, Any]) -> str:
        theirs = {"fingerprint": fingerprint, **options}
        ours = {"fingerprint": job.fingerprint, "sharding": job.sharding,
                "deterministic": job.deterministic, "on_error": job.on_error,
                "num_workers": job.options["num_workers"],
                "balanced": job.options.get("balanced", 0),
                "num_consumers": job.options.get("num_consumers", 0),
                "exactly_once": job.track}
        diff = [k for k in ours if ours[k] != theirs[k] and k != "num_workers"]
        if not diff:
            return ""
        return (f"job_name {job.name!r} already runs another pipeline or options "
                f"({', '.join(f'{k}: {ours[k]!r} vs {theirs[k]!r}' for k in diff)}); "
                "use another job_name, or the same pipeline and options")

    def _new_job(self, msg: Message, fingerprint: str, name: str | None,
                 options: dict[str, Any], source: dict[str, Any], now: float) -> Job:
        num_splits = source.get("num_splits")
        seed = source.get("seed")
        if not isinstance(num_splits, int) or num_splits < 0:
            raise ProtocolError("REGISTER: source.num_splits must be an int >= 0")
        if seed is not None and not isinstance(seed, int):
            raise ProtocolError("REGISTER: source.seed must be an int or null")
        live = sum(1 for w in self.workers.values() if w.task is None)
        width = options["num_workers"] or max(1, live)
        job = Job(secrets.token_hex(8), fingerprint, name, options["sharding"],
                  options["deterministic"], options["on_error"], options, bytes(msg.payload[0]),
                  num_splits, bool(source.get("shuffle_splits", False)), seed, width,
                  _source_data(msg.body.get("source_data")), secrets.randbits(63), now)
        job.track = options["exactly_once"]
        job.pipeline = _pipeline_ref(msg.body.get("pipeline"), job.blob)
        job.scaler.cooldown = self.cooldown
        entropy = msg.body.get("entropy")  # a resumed Loader's: its shuffles draw the same
        if isinstance(entropy, int) and not isinstance(entropy, bool) and 0 <= entropy < 2**63:
            job.entropy = entropy
        self.jobs[job.id] = job
        if self.journal is not None:
            self.journal.save_pipeline(job.id, job.blob)
        self._record(_job_event(job))
        return job

    def epoch_started(self, identity: bytes, msg: Message, now: float) -> list[Out]:
        consumer = self._consumer(identity)
        job = self.jobs.get(consumer.job) if consumer is not None else None
        epoch = msg.body.get("epoch")
        out: list[Out] = []
        if job is not None and isinstance(epoch, int) and not isinstance(epoch, bool):
            if epoch > job.epoch:
                self._record({"e": "epoch", "job": job.id, "epoch": epoch})
            job.epoch = max(job.epoch, epoch)
            job.hungry_until = now + 2 * self.heartbeat  # it has nothing yet
            if consumer is not None:
                consumer.active = True
            if job.rounds is not None and consumer is not None:
                out += self._announce(job, {}, job.rounds.epoch_started(consumer.id, epoch))
                job.rounds.prune(job.epoch)
                if self._pending(job).get(str(epoch)):
                    job.rounds.order_rerun(epoch, job.requeues.get(epoch, 0))
        # A hungry job may take a worker from another now (zloader/pool.py); the answer
        # below is the only JOB this consumer gets now, as for REGISTER.
        out += [o for o in self._assign(now)
                if o.identity != identity or o.command is not Command.JOB]
        answer = self.consumer_heartbeat(identity, now)
        if job is not None and job.track and isinstance(epoch, int):
            for reply in [r for r in answer if r.command is Command.JOB]:
                # what the consumer checks its epoch against
                reply.body["read"] = [[list(key), pack(splits)] for key, splits
                                      in sorted(self._read_splits(job, epoch).items())]
        return out + answer

    def consumer_heartbeat(self, identity: bytes, now: float,
                           msg: Message | None = None) -> list[Out]:
        consumer = self._consumer(identity)
        if consumer is None:
            return []
        job = self.jobs.get(consumer.job)
        stats = msg.body.get("stats") if msg is not None else None
        out: list[Out] = []
        if job is not None and msg is not None and "stuck" in msg.body:
            out += self._stuck(job, consumer, msg.field("stuck", list), now)
        if job is not None and msg is not None and "reread" in msg.body:
            self._reread(job, consumer, msg.field("reread", list))
        if isinstance(stats, dict):
            stats = {k: v for k, v in stats.items() if isinstance(v, (int, float))
                     and not isinstance(v, bool) and v >= 0}
            if job is not None:
                job.wait_seconds += _delta(stats, consumer.stats, "wait_seconds")
                job.skipped += int(_delta(stats, consumer.stats, "skipped"))
            consumer.stats = stats
            consumer.active = stats.get("active", 1) != 0
        return out + ([Out(identity, Command.JOB, self.job_view(job))] if job else [])

    def _reread(self, job: Job, consumer: Consumer, entries: list[Any]) -> None:
        """The job's only consumer ended an epoch short (``HEARTBEAT.reread``): records of
        these splits never reached it (unmapped segments a worker unlinked while it was
        stalled, records taken by another peer with its token). Hand each out again, less
        the indices it holds, as after a worker's death; its next ``EPOCH`` finds them
        pending and runs the epoch again. Only splits the broker handed out in that pass
        and holds no fence or re-queue for are taken.

        Raises:
            ProtocolError: an entry is not ``[pass, split, info]``.
        """
        if not job.track or len(job.consumers | set(job.silent)) != 1:
            return  # with several consumers none can tell alone what is missing
        fenced = {at for fence in job.fences.values() for at in fence.splits}
        read: dict[int, dict[tuple[int, ...], set[int]]] = {}  # by epoch
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], list)
                    and entry[0] and all(isinstance(k, int) and k >= 0 for k in entry[0])
                    and isinstance(entry[1], int) and isinstance(entry[2], dict)):
                raise ProtocolError("HEARTBEAT.reread: each entry must be [pass, split, info]")
            key, split = tuple(entry[0]), entry[1]
            if key[0] not in read:
                read[key[0]] = self._read_splits(job, key[0])
            if split not in read[key[0]].get(key, set()) \
                    or (key, split) in fenced \
                    or any(split in p.requeued for k, p in job.passes.items() if k[0] == key[0]):
                continue
            try:
                skip = _skip(merge_info(None, entry[2]))
            except ValueError as exc:
                raise ProtocolError(f"HEARTBEAT.reread: {exc}") from None
            log.warning("consumer %s ended epoch %d of job %s without all of split %d (pass "
                        "%s): read again", consumer.id, key[0], job.id, split, list(key))
            self._requeue(job, key, split, skip)

    @staticmethod
    def _read_splits(job: Job, epoch: int) -> dict[tuple[int, ...], set[int]]:
        """Pass -> the splits of ``epoch`` handed out to live workers (being read or read),
        by the pass they belong to (a re-queued split may be read in a later pass)."""
        read: dict[tuple[int, ...], set[int]] = {}
        for key, dispenser in job.passes.items():
            if key[0] != epoch:
                continue
            for splits in [*dispenser.handed.values(), *dispenser.read.values()]:
                for split in splits:
                    read.setdefault(job.origin_of.get((key, split), key), set()).add(split)
        return read

    def _stuck(self, job: Job, consumer: Consumer, reports: list[Any],
               now: float) -> list[Out]:
        """A consumer got nothing from these workers of its job for its ``timeout`` though
        they held its credits (``HEARTBEAT.stuck``): each is alive (it heartbeats) but its
        user code is blocked. It is told to drop the task (``RELEASE``; a worker whose
        producer does not stop replaces its process) and dropped from the broker as if it
        had died: its splits go to the other workers, exactly once for an exactly-once job
        (a :class:`Fence`), and a split that wedges ``KILLS_TO_FAIL`` workers is reported.

        Raises:
            ProtocolError: a report is not ``{worker, task, seconds}``.
        """
        out: list[Out] = []
        for report in reports:
            if not (isinstance(report, dict) and isinstance(report.get("worker"), str)
                    and isinstance(report.get("task"), str)
                    and isinstance(report.get("seconds"), (int, float))
                    and not isinstance(report.get("seconds"), bool)):
                raise ProtocolError("HEARTBEAT.stuck must list {worker, task, seconds}")
            worker = self.workers.get(report["worker"])
            if worker is None or worker.task != report["task"] \
                    or job.tasks.get(report["task"]) != worker.id:
                continue  # gone already, or not this consumer's job's worker
            log.warning("worker %s (pid %d on %s) sent consumer %s nothing for %.1f s though "
                        "it held credits (doing %s): dropped from job %s as stuck",
                        worker.id, worker.pid, worker.host, consumer.id,
                        float(report["seconds"]), worker.doing, job.id)
            out.append(Out(worker.identity, Command.RELEASE, {"task": worker.task}))
            out += self._drop_worker(worker.id, died=True, now=now)
        return out

    def job_view(self, job: Job) -> dict[str, Any]:
        workers: list[dict[str, Any]] = []
        for task, worker_id in job.tasks.items():
            worker = self.workers.get(worker_id)
            if worker is not None:
                workers.append({"worker": worker.id, "task": task,
                                "endpoint": worker.endpoint,
                                "host_id": worker.host_id, "index": job.indices[task],
                                "pid": worker.pid, "host": worker.host,
                                "plain_data": worker.plain_data})
                if worker.doing is not None:
                    workers[-1]["doing"] = worker.doing
        workers.sort(key=lambda w: w["index"])
        pending = self._pending(job)
        view = {"job": job.id, "workers": workers, "failed": job.failed, "error": job.error,
                "heartbeat": self.heartbeat, "consumers": len(job.consumers | set(job.silent)),
                "busy_elsewhere": sum(1 for w in self.workers.values()
                                      if w.task is not None and w.task not in job.tasks),
                "pending": pending, "share": job.share, "epoch": job.epoch,
                "width": job.width, "entropy": job.entropy,
                "stages": {k: round(v, 3) for k, v in job.stages.items()},
                "state": "failed" if job.error else "running"}
        if job.rounds is not None:
            view["rounds"] = job.rounds.view()
        if job.fences:
            view["fences"] = [{"id": token, "worker": fence.worker, "task": fence.task,
                               "splits": [[list(key), split] for key, split in fence.splits],
                               "waiting": sorted(fence.waiting)}
                              for token, fence in job.fences.items()]
            fencing: dict[str, int] = {}
            for fence in job.fences.values():
                for key, _ in fence.splits:
                    fencing[str(key[0])] = fencing.get(str(key[0]), 0) + 1
            view["fencing"] = fencing
        return view

    @staticmethod
    def _pending(job: Job) -> dict[str, int]:
        """Epoch -> splits waiting to be read again (taken by a worker that died)."""
        pending: dict[str, int] = {}
        for key, dispenser in job.passes.items():
            waiting = len(dispenser.requeued)
            if waiting:
                pending[str(key[0])] = pending.get(str(key[0]), 0) + waiting
        return pending

    # --- tasks and splits -----------------------------------------------------------------

    def _assign(self, now: float) -> list[Out]:
        """Give free workers to jobs, then move busy ones where the pool's policy says
        (zloader/pool.py, docs/pool.md): every job with consumers gets its share."""
        return self._fill(now) + self._rebalance(now)

    def _fill(self, now: float) -> list[Out]:
        """Give each free worker a job: its preferred job first, then the job furthest
        below its share of the pool, one whose consumers share the worker's host, the job
        with the fewest workers (static jobs take at most ``width``). Workers on a host
        with consumers go first (hybrid placement: shared memory is the cheapest path)."""
        out: list[Out] = []
        if all(w.task is not None for w in self.workers.values()):
            return out
        entitled = pool.shares(self._claims(now).values(), len(self.workers))
        job_hosts = {j.id: self._hosts(j) for j in self.jobs.values()}
        hosts = {c.host_id for c in self.consumers.values()}
        idle = sorted((w for w in self.workers.values() if w.task is None),
                      key=lambda w: w.host_id not in hosts)
        for worker in idle:
            open_jobs = [j for j in self.jobs.values() if j.error is None and j.consumers
                         and ((j.sharding != "static" and not j.deterministic)
                              or len(j.tasks) < j.width)]
            if not open_jobs:
                break
            open_jobs = [j for j in open_jobs if self._can_serve(worker, j, job_hosts)]
            if not open_jobs:
                continue
            preferred = [j for j in open_jobs if j.id == worker.prefer]
            job = preferred[0] if preferred else min(open_jobs, key=lambda j: (
                len(j.tasks) - entitled.get(j.id, 0.0), worker.host_id not in job_hosts[j.id],
                len(j.tasks), j.created))
            out += self._give(worker, job, now)
        return out

    @staticmethod
    def _can_serve(worker: Worker, job: Job, job_hosts: dict[str, set[str]]) -> bool:
        """Whether ``worker`` can run ``job`` at all: a pipeline only forked workers hold
        (embedded) runs on none other, and a worker whose data port is on loopback only
        serves consumers on its own host."""
        if job.pipeline == INHERITED and job.fingerprint not in worker.holds:
            return False
        return not loopback(worker.endpoint) or worker.host_id in job_hosts[job.id]

    def _give(self, worker: Worker, job: Job, now: float) -> list[Out]:
        """Start a task of ``job`` on the free ``worker``."""
        task = secrets.token_hex(8)
        used = set(job.indices.values())
        index = next(i for i in range(len(used) + 1) if i not in used)
        job.tasks[task] = worker.id
        job.indices[task] = index
        worker.task = task
        worker.since = now
        self._record({"e": "task", "job": job.id, "task": task, "worker": worker.id,
                      "index": index})
        body = {"task": task, "job": job.id, "sharding": job.sharding, "index": index,
                "width": job.width, "deterministic": job.deterministic,
                "on_error": job.on_error, "entropy": job.entropy,
                "source_data": job.source_data, "share": job.share,
                "fingerprint": job.fingerprint, "pipeline": job.pipeline,
                "balanced": job.options.get("balanced", 0),
                "coordinated": job.rounds.size if job.rounds is not None else 0,
                "track": job.track}
        return [Out(worker.identity, Command.TASK, body, (job.blob,)),
                *self._tell_consumers(job)]

    def _claims(self, now: float) -> dict[str, pool.Claim]:
        """What each job asks of the pool now (zloader/pool.py)."""
        claims = {}
        for job in self.jobs.values():
            consumers = [c for cid in job.consumers if (c := self.consumers.get(cid))]
            active = job.error is None and any(c.active for c in consumers)
            fixed = job.sharding == "static" or job.deterministic
            hungry = active and (job.starvation > HUNGRY_STARVATION or now < job.hungry_until)
            if not active:
                wants = 0
            elif fixed:
                wants = job.width
            elif hungry or not job.desired:
                wants = pool.UNBOUNDED  # its consumers wait: it can use more workers
            else:  # its autoscaler's count, once it has more than its consumers take
                wants = job.desired
            claims[job.id] = pool.Claim(job.id, job.weight, len(job.tasks), wants, hungry,
                                        movable=not fixed or not active)
        return claims

    def _rebalance(self, now: float) -> list[Out]:
        """Move busy workers to hungry jobs below their share, one at a time, each leaving
        its job as a draining worker does (exactly once: see :meth:`_leave`)."""
        out: list[Out] = []
        job_hosts = {j.id: self._hosts(j) for j in self.jobs.values()}
        for _ in range(len(self.workers)):
            holdings = []
            for job in self.jobs.values():
                hosts = job_hosts[job.id]
                for task, worker_id in job.tasks.items():
                    worker = self.workers.get(worker_id)
                    if worker is not None:  # remote ones and the last assigned go first
                        holdings.append(pool.Holding(
                            worker_id, job.id, worker.since,
                            rank=2 * (worker.host_id in hosts) - job.indices.get(task, 0)))

            def eligible(worker_id: str, job_id: str) -> bool:
                return self._can_serve(self.workers[worker_id], self.jobs[job_id], job_hosts)

            move = pool.next_move(self._claims(now).values(), holdings, eligible, now)
            if move is None:
                break
            worker, job = self.workers[move[0]], self.jobs[move[1]]
            out += self._preempt(worker, now)
            out += self._give(worker, job, now)
        return out

    def _preempt(self, worker: Worker, now: float) -> list[Out]:
        """Take ``worker`` off its job for another: it drops the task (``RELEASE``) and
        its splits go to the job's other workers, as a dead worker's do (exactly once for
        an exactly-once job: a :class:`Fence`), but it stays registered."""
        task = worker.task
        job = self.jobs[self._task_job(task) or ""]
        assert task is not None
        log.info("worker %s (pid %d on %s) moves off job %s (the pool's share for another "
                 "job)", worker.id, worker.pid, worker.host, job.name or job.id)
        return [Out(worker.identity, Command.RELEASE, {"task": task}),
                *self._leave(worker, job, task, died=False, now=now, stays=True)]

    def _tell_consumers(self, job: Job) -> list[Out]:
        view = self.job_view(job)
        return [Out(c.identity, Command.JOB, view) for cid in job.consumers
                if (c := self.consumers.get(cid)) is not None]

    def split_request(self, identity: bytes, msg: Message, now: float) -> list[Out]:
        worker = self._worker(identity)
        task = msg.field("task", str)
        key = tuple(msg.field("pass", list))
        if not key or not all(isinstance(k, int) and k >= 0 for k in key):
            raise ProtocolError("SPLIT_REQ: pass must be a non-empty list of ints >= 0")
        job = self.jobs.get(self._task_job(task) or "")
        if worker is None or job is None or worker.task != task:
            return [Out(identity, Command.RELEASE, {"task": task})]
        dispenser = self._dispenser(job, key)
        have = msg.body.get("have")
        handed = dispenser.handed.get(worker.id, [])
        if isinstance(have, int) and not isinstance(have, bool) and 0 <= have < len(handed):
            # Its answer was lost (a broker restart or a reconnect): the same split again.
            return [Out(identity, Command.SPLIT, {
                "task": task, "pass": list(key), "split": handed[have], "have": have,
                **self._assignment(job, key, handed[have])})]
        split: int | None = None
        origin = key
        # Re-queued splits of this epoch come first, whichever pass they were taken in: the
        # live workers may have moved past that pass (an endless repeat) and never ask
        # for it again. A split reads the same in any pass of its epoch.
        for waiting_key, waiting in [(key, dispenser), *((k, p) for k, p in job.passes.items()
                                                         if k[0] == key[0] and k != key)]:
            if waiting.requeued:
                split, origin = waiting.requeued.popleft(), waiting_key
                break
        if split is None and dispenser.order:
            split = dispenser.order.popleft()
        if split is not None:
            dispenser.handed.setdefault(worker.id, []).append(split)
            worker.current = (key, split)
            event = {"e": "split", "job": job.id, "pass": list(key), "split": split,
                     "worker": worker.id}
            if origin != key:
                job.origin_of[(key, split)] = origin
                event["origin"] = list(origin)
            self._record(event)
        else:
            worker.current = None
        return [Out(identity, Command.SPLIT, {"task": task, "pass": list(key), "split": split,
                                              "have": have,
                                              **self._assignment(job, key, split)})]

    @staticmethod
    def _assignment(job: Job, key: tuple[int, ...], split: int | None) -> dict[str, Any]:
        """For an exactly-once job: the pass ``split`` belongs to and what to skip in it."""
        if not job.track or split is None:
            return {}
        origin = job.origin_of.get((key, split), key)
        dispenser = job.passes.get(origin)
        info = dispenser.skips.get(split, {}) if dispenser is not None else {}
        return {"origin": list(origin), **info}

    def _dispenser(self, job: Job, key: tuple[int, ...]) -> Pass:
        dispenser = job.passes.get(key)
        if dispenser is None:
            order = split_order(job.num_splits, job.shuffle_splits, job.seed, job.entropy, key)
            skips: dict[int, dict[str, Any]] = {}
            if job.resume is not None and job.resume[0] == key[0]:
                ledger = job.resume[1]  # what a resumed Loader had yielded: not again
                done = ledger.done.get(key, set())
                order = [split for split in order if split not in done]
                skips = {split: _skip(ledger.info(key, split)) for k, split in ledger.open
                         if k == key}
            dispenser = job.passes[key] = Pass(deque(order), skips=skips)
            self._prune(job, key[0])
        return dispenser

    def _prune(self, job: Job, epoch: int) -> None:
        for key in [k for k in job.passes if k[0] < epoch - 1]:
            del job.passes[key]
        for old in [e for e in job.requeues if e < epoch - 1]:
            del job.requeues[old]
        for at in [at for at in job.origin_of if at[0][0] < epoch - 1]:
            del job.origin_of[at]

    def pass_done(self, identity: bytes, msg: Message, now: float) -> None:
        worker = self._worker(identity)
        key = tuple(msg.field("pass", list))
        job = self.jobs.get(self._task_job(msg.field("task", str)) or "")
        if worker is None or job is None or key not in job.passes:
            return
        self._pass_done(job, key, worker.id)
        if worker.current and worker.current[0] == key:
            worker.current = None
        self._record({"e": "done", "job": job.id, "pass": list(key), "worker": worker.id})

    @staticmethod
    def _pass_done(job: Job, key: tuple[int, ...], worker_id: str) -> None:
        dispenser = job.passes[key]
        handed = dispenser.handed.pop(worker_id, [])
        if job.track:  # read, but its elements may wait in the worker's buffers
            dispenser.read.setdefault(worker_id, []).extend(handed)

    def task_failed(self, identity: bytes, msg: Message, now: float) -> list[Out]:
        job = self.jobs.get(self._task_job(msg.field("task", str)) or "")
        if job is None:
            return []
        error = msg.field("error", dict)
        job.error = {k: str(error.get(k, "")) for k in ("stage", "exc_type", "builtin",
                                                        "message", "traceback", "context")}
        self._record({"e": "failed", "job": job.id, "error": job.error})
        return self._release_job(job, now) + self._tell_consumers(job)

    def _task_job(self, task: str | None) -> str | None:
        if task is None:
            return None
        return next((j.id for j in self.jobs.values() if task in j.tasks), None)

    # --- coordinated reads (zloader/rounds.py) ---------------------------------------------

    def round_request(self, identity: bytes, msg: Message, now: float) -> list[Out]:
        """A worker has a round's elements ready: number it (or refuse, ``round`` null)."""
        worker = self._worker(identity)
        task = msg.field("task", str)
        epoch = msg.field("epoch", int)
        members = msg.field("members", list)
        job = self.jobs.get(self._task_job(task) or "")
        if worker is None or job is None or job.rounds is None or worker.task != task:
            return [Out(identity, Command.ROUND, {"task": task, "epoch": epoch,
                                                  "round": None})]
        number = job.rounds.issue(worker.id, epoch, members)
        return [Out(identity, Command.ROUND, {"task": task, "epoch": epoch, "round": number})]

    def rounds_received(self, identity: bytes, msg: Message, now: float) -> list[Out]:
        """A consumer received its elements of some rounds: commit the complete ones."""
        consumer = self._consumer(identity)
        job = self.jobs.get(consumer.job) if consumer is not None else None
        if consumer is None or job is None or job.rounds is None:
            return []
        epoch = msg.field("epoch", int)
        numbers = [n for n in msg.field("rounds", list) if isinstance(n, int)]
        if job.rounds.index_of(consumer.id) is None:
            return []
        committed, again = job.rounds.got(consumer.id, epoch, numbers)
        out = self._announce(job, {epoch: committed} if committed else {}, {})
        if again["rounds"] or again["lost"]:  # answered to this consumer alone
            out.append(Out(identity, Command.COMMIT, {"epoch": epoch, **again,
                                                      "total_lost": job.rounds.lost}))
        return out

    def _announce(self, job: Job, committed: dict[int, list[int]],
                  lost: dict[int, list[int]]) -> list[Out]:
        """Tell every consumer of a coordinated job which rounds were committed or lost."""
        assert job.rounds is not None
        out = []
        for epoch in sorted(set(committed) | set(lost)):
            body = {"epoch": epoch, "rounds": committed.get(epoch, []),
                    "lost": lost.get(epoch, []), "total_lost": job.rounds.lost}
            for consumer_id in job.rounds.members.values():
                consumer = self.consumers.get(consumer_id)
                if consumer is not None:
                    out.append(Out(consumer.identity, Command.COMMIT, body))
        return out

    # --- leaving, dying and collecting ----------------------------------------------------

    def bye(self, identity: bytes, now: float) -> list[Out]:
        kind, pid = self.peers.get(identity, ("", ""))
        if kind == "worker":
            return self._drop_worker(pid, died=False, now=now)
        if kind == "consumer":
            consumer = self.consumers.get(pid)
            out = self._drop_consumer(pid, now)
            job = self.jobs.get(consumer.job) if consumer is not None else None
            if job is not None and not job.consumers \
                    and not any(now - t < self.expiry * FENCE_GRACE
                                for t in job.silent.values()):
                # Its last consumer left: nobody comes back to it, so its name and
                # workers are free now (not an expiry later) for the next job.
                out += self._end_job(job, now)
                out += self._assign(now)
            return out
        return []

    def tick(self, now: float) -> list[Out]:
        """Purge peers silent for ``liveness`` heartbeats and collect abandoned jobs."""
        out: list[Out] = []
        for worker in [w for w in self.workers.values() if now - w.last_seen > self.expiry]:
            log.info("worker %s (pid %d on %s) silent for %.1f s: dropped", worker.id,
                     worker.pid, worker.host, now - worker.last_seen)
            out += self._drop_worker(worker.id, died=True, now=now)
        for consumer in [c for c in self.consumers.values() if now - c.last_seen > self.expiry]:
            log.info("consumer %s (pid %d) silent for %.1f s: dropped", consumer.id,
                     consumer.pid, now - consumer.last_seen)
            out += self._drop_consumer(consumer.id, now, silent=True)
        for job in self.jobs.values():
            for fence in job.fences.values():
                if now > fence.deadline and fence.waiting:
                    self._give_up(job, fence, now)
            out += self._complete_fences(job)
            for consumer_id in [c for c, t in job.silent.items()
                                if now - t > self.expiry * FENCE_GRACE]:
                del job.silent[consumer_id]
        if self.journal is not None and self.journal.lines > COMPACT_LINES:
            self.journal.compact(self.snapshot())
        self._sample(now)
        for job in list(self.jobs.values()):
            if not job.consumers and job.idle_since is not None \
                    and now - job.idle_since > max(self.expiry, job.linger):
                out += self._end_job(job, now)
        return out + self._assign(now)

    def _end_job(self, job: Job, now: float) -> list[Out]:
        """Forget ``job``: its workers are released, its name is free."""
        out = self._release_job(job, now)
        del self.jobs[job.id]
        self._record({"e": "end", "job": job.id})
        if self.journal is not None:
            self.journal.forget_pipeline(job.id)
        return out

    def _give_up(self, job: Job, fence: Fence, now: float) -> None:
        """A fence's deadline passed: stop waiting for the consumers that are gone (what
        they held may repeat). Those still registered with the job are alive: their answer
        was lost or is late, and every ``JOB`` view asks them again, so the fence waits
        for them another grace period."""
        gone = {c for c in fence.waiting if c not in job.consumers}
        if gone:
            log.warning("consumers %s did not answer for the splits of dead worker %s: "
                        "they are read again (what they held may repeat)", sorted(gone),
                        fence.worker)
        fence.waiting -= gone
        if fence.waiting:
            log.warning("consumers %s of job %s have not answered for the splits of dead "
                        "worker %s yet: asking them again", sorted(fence.waiting),
                        job.name or job.id, fence.worker)
            fence.deadline = now + self.expiry * FENCE_GRACE

    def stalled(self, seconds: float, now: float) -> None:
        """The broker itself did not run for ``seconds`` (SIGSTOP, a long GC, a slow
        disk) until ``now``: its peers could not be heard meanwhile, so that time is not
        held against them. Their silences, the jobs' idle times and the fences' deadlines
        move forward by it; a peer that really died is still dropped, an expiry later."""
        records: list[Worker | Consumer] = [*self.workers.values(), *self.consumers.values()]
        for record in records:
            record.last_seen = min(now, record.last_seen + seconds)
        for job in self.jobs.values():
            job.silent = {c: min(now, t + seconds) for c, t in job.silent.items()}
            if job.idle_since is not None:
                job.idle_since = min(now, job.idle_since + seconds)
            for fence in job.fences.values():
                fence.deadline += seconds

    def heartbeats(self) -> list[Out]:
        """What the broker sends every heartbeat interval."""
        out = [Out(w.identity, Command.HEARTBEAT, {}) for w in self.workers.values()]
        for consumer in self.consumers.values():
            job = self.jobs.get(consumer.job)
            if job is not None:
                out.append(Out(consumer.identity, Command.JOB, self.job_view(job)))
        return out

    def _drop_worker(self, worker_id: str, died: bool, now: float,
                     requeue: bool = True) -> list[Out]:
        """Forget a worker; its splits not yet delivered are read again by others (see
        :meth:`_leave`)."""
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return []
        self.peers.pop(worker.identity, None)
        job = self.jobs.get(self._task_job(worker.task) or "")
        if job is None or worker.task is None:
            self._record({"e": "gone", "worker": worker_id, "died": died})
            return []
        return self._leave(worker, job, worker.task, died, now, requeue)

    def _leave(self, worker: Worker, job: Job, task: str, died: bool, now: float,
               requeue: bool = True, stays: bool = False) -> list[Out]:
        """Take a worker's ``task`` off ``job``: its splits not yet delivered are read
        again by the others, for an exactly-once job once its consumers have said what they
        hold (see :class:`Fence`). ``stays``: the worker is not gone, only moved to another
        job (:meth:`_preempt`). ``requeue=False`` replays a fenced leave, whose re-queued
        splits follow in the journal."""
        worker_id = worker.id
        job.indices.pop(task, None)
        job.tasks.pop(task, None)
        current = worker.current if worker.task == task else None
        if stays and worker.task == task:
            worker.task, worker.current, worker.idle_since = None, None, now
        lost: list[tuple[tuple[int, ...], int]] = []
        for key, dispenser in job.passes.items():
            handed = dispenser.handed.pop(worker_id, [])
            for split in handed:
                if died and current == (key, split):
                    job.kills[split] = job.kills.get(split, 0) + 1
                    if job.kills[split] >= KILLS_TO_FAIL:
                        job.failed.append({"split": split, "pass": list(key), "message": (
                            f"split {split} was being read when its worker died "
                            f"{KILLS_TO_FAIL} times (last: worker pid {worker.pid} on "
                            f"{worker.host}); it is skipped")})
                        continue
                lost.append((job.origin_of.get((key, split), key), split))
            lost += [(job.origin_of.get((key, split), key), split)
                     for split in dispenser.read.pop(worker_id, [])]
        event = ({"e": "left", "job": job.id, "task": task, "worker": worker_id} if stays
                 else {"e": "gone", "worker": worker_id, "died": died})
        grace = self.expiry * FENCE_GRACE
        asked = job.consumers | {c for c, t in job.silent.items() if now - t < grace}
        if job.track and lost and asked and not self._replaying:
            job.fences[secrets.token_hex(6)] = Fence(worker_id, task, died, lost, asked,
                                                     now + grace, event=event)
            return self._tell_consumers(job)  # the leave is journaled once the fence is done
        self._record(event)
        if requeue:
            for key, split in lost:
                self._requeue(job, key, split, {})
        out = self._tell_consumers(job)
        if job.rounds is not None:
            out += self._announce(job, {}, job.rounds.lose_worker(worker_id))
        return out

    def _requeue(self, job: Job, key: tuple[int, ...], split: int,
                 skip: dict[str, Any]) -> None:
        """Hand ``split`` of pass ``key`` out again (to skip ``skip``), ahead of new ones."""
        self._record({"e": "requeue", "job": job.id, "pass": list(key), "split": split,
                      "skip": skip})
        dispenser = self._dispenser(job, key)
        dispenser.requeued.append(split)
        if skip:
            dispenser.skips[split] = skip
        job.requeues[key[0]] = job.requeues.get(key[0], 0) + 1

    def delivered(self, identity: bytes, msg: Message, now: float) -> list[Out]:
        """A consumer says which elements of a dead worker's splits it holds (and that it
        reads nothing more from that worker)."""
        consumer = self._consumer(identity)
        job = self.jobs.get(consumer.job) if consumer is not None else None
        fence = job.fences.get(msg.field("fence", str)) if job is not None else None
        if consumer is None or job is None or fence is None \
                or consumer.id not in fence.waiting:
            return []
        wanted = set(fence.splits)
        for entry in msg.field("splits", list):
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], list)
                    and isinstance(entry[1], int) and isinstance(entry[2], dict)):
                raise ProtocolError("DELIVERED: each split must be [pass, split, info]")
            at = (tuple(entry[0]), entry[1])
            if at in wanted:
                try:
                    fence.replies[at] = merge_info(fence.replies.get(at), entry[2])
                except ValueError as exc:
                    raise ProtocolError(f"DELIVERED: {exc}") from None
        fence.waiting.discard(consumer.id)
        return self._complete_fences(job)

    def _complete_fences(self, job: Job) -> list[Out]:
        """Re-queue the splits of every fence all consumers answered, less what they hold."""
        done = [token for token, fence in job.fences.items() if not fence.waiting]
        for token in done:
            fence = job.fences.pop(token)
            self._record({**fence.event, "fenced": True})
            for key, split in fence.splits:
                info = fence.replies.get((key, split), {})
                if not info.get("all") and (key[0] >= job.epoch - 1):
                    self._requeue(job, key, split, _skip(info))
        return self._tell_consumers(job) if done else []

    def _drop_consumer(self, consumer_id: str, now: float,
                       silent: bool = False) -> list[Out]:
        """Forget a consumer. One that went ``silent`` (not one that said BYE) may only be
        stalled: the fences of its job still wait for its answer until their deadline."""
        consumer = self.consumers.pop(consumer_id, None)
        if consumer is None:
            return []
        self.peers.pop(consumer.identity, None)
        job = self.jobs.get(consumer.job)
        if job is None:
            return []
        job.consumers.discard(consumer_id)
        if not job.consumers:
            job.idle_since = now
            # Consumers that went silent may only be stalled (a loaded host): keep the job,
            # its workers and what it handed out, for them to come back to.
            job.linger = self.expiry * FENCE_GRACE if silent else 0.0
        if silent:
            job.silent[consumer_id] = now
        else:
            for fence in job.fences.values():
                fence.waiting.discard(consumer_id)
        out = self._complete_fences(job)
        if job.rounds is not None:
            out += self._announce(job, {}, job.rounds.leave(consumer_id))
        for task, worker_id in job.tasks.items():
            worker = self.workers.get(worker_id)
            if worker is not None:
                out.append(Out(worker.identity, Command.CONSUMER_GONE,
                               {"task": task, "consumer": consumer_id}))
        return out

    def _release_job(self, job: Job, now: float) -> list[Out]:
        out = []
        for task, worker_id in list(job.tasks.items()):
            worker = self.workers.get(worker_id)
            if worker is not None:
                worker.task = None
                worker.current = None
                worker.idle_since = now
                out.append(Out(worker.identity, Command.RELEASE, {"task": task}))
        job.tasks.clear()
        job.indices.clear()
        return out

    def _worker(self, identity: bytes) -> Worker | None:
        kind, pid = self.peers.get(identity, ("", ""))
        return self.workers.get(pid) if kind == "worker" else None

    def _consumer(self, identity: bytes) -> Consumer | None:
        kind, pid = self.peers.get(identity, ("", ""))
        return self.consumers.get(pid) if kind == "consumer" else None

    # --- the journal (zloader/journal.py) -------------------------------------------------

    def _record(self, event: dict[str, Any]) -> None:
        if self.journal is not None and not self._replaying \
                and not self.journal.record(event):
            # Not written (a full disk): the job could not be resumed after a restart.
            job = event.get("id") if event["e"] == "job" else event.get("job")
            if isinstance(job, str):
                self._unjournaled.add(job)

    def journal_errors(self) -> list[Out]:
        """ERROR, naming the work dir and the failure, to each consumer of a job whose
        journal writes failed (once per consumer). Their Loaders raise it; the job and
        the others go on in memory."""
        if not self._unjournaled or self.journal is None:
            return []
        out = []
        for job_id in list(self._unjournaled):
            job = self.jobs.get(job_id)
            if job is None:
                self._unjournaled.discard(job_id)
                continue
            for consumer_id in job.consumers - self._told:
                consumer = self.consumers.get(consumer_id)
                if consumer is not None:
                    self._told.add(consumer_id)
                    out.append(Out(consumer.identity, Command.ERROR,
                                   {"message": self.journal.failure}))
        return out

    _replaying = False

    def restore(self, now: float) -> int:
        """Rebuild the state from the journal (a restarted broker): jobs, tasks, splits
        handed out and finished, epochs. Workers come back as they were and must reconnect
        within ``liveness`` heartbeats, or their splits go to others. Returns the number of
        jobs restored."""
        if self.journal is None:
            return 0
        self._replaying = True
        journal = self.journal
        try:
            for number, event in journal.replay():
                try:
                    self._apply(event, now)
                except Exception:  # one bad line must not stop the broker
                    log.debug("journal line %d: cannot apply %s", number, event,
                              exc_info=True)
                    journal.skipped.append(number)
        finally:
            self._replaying = False
        if journal.skipped:
            shown = ", ".join(map(str, journal.skipped[:20]))
            log.warning("journal %s: skipped %d lines (%s%s) that are torn, not UTF-8 JSON or "
                        "events it could not apply; the rest was restored", journal.path,
                        len(journal.skipped), shown, ", ..." if len(journal.skipped) > 20
                        else "")
        for job in self.jobs.values():
            job.idle_since = now  # collected unless a consumer comes back
            job.scaler.cooldown = self.cooldown
        return len(self.jobs)

    def _apply(self, event: dict[str, Any], now: float) -> None:
        kind = event["e"]
        job = self.jobs.get(str(event.get("job")))
        if kind == "worker":
            self.workers[event["id"]] = Worker(
                event["id"], b"", event["host"], event["host_id"], int(event["pid"]),
                event["endpoint"], event.get("prefer"), now,
                plain_data=event.get("plain_data") is True, idle_since=now)
        elif kind == "job":
            blob = self.journal.load_pipeline(event["id"]) if self.journal else None
            if blob is None:
                return
            options = event["options"]
            if options["sharding"] not in SHARDING_MODES:
                raise ValueError(f"unknown sharding {options['sharding']!r}")
            self.jobs[event["id"]] = Job(
                event["id"], event["fingerprint"], event["name"], options["sharding"],
                options["deterministic"], options["on_error"], options, blob,
                event["num_splits"], event["shuffle_splits"], event["seed"], event["width"],
                event["source_data"], event["entropy"], now,
                track=bool(options.get("exactly_once")),
                pipeline=_pipeline_ref(event.get("pipeline"), blob))
        elif kind == "gone":
            self._drop_worker(event["worker"], bool(event.get("died")), now,
                              requeue=not event.get("fenced"))
        elif job is None:
            return
        elif kind == "left":  # moved to another job (State._preempt)
            worker = self.workers.get(event["worker"])
            if worker is not None and event["task"] in job.tasks:
                self._leave(worker, job, event["task"], False, now,
                            requeue=not event.get("fenced"), stays=True)
        elif kind == "share":
            job.share = event["share"]
        elif kind == "rounds":
            job.rounds = Rounds(int(event["size"]))
        elif kind == "task":
            job.tasks[event["task"]] = event["worker"]
            job.indices[event["task"]] = int(event["index"])
            if event["worker"] in self.workers:
                self.workers[event["worker"]].task = event["task"]
        elif kind == "split":
            key = tuple(event["pass"])
            self._take(job, event["worker"], key, int(event["split"]))
            if event.get("origin"):
                job.origin_of[(key, int(event["split"]))] = tuple(event["origin"])
        elif kind == "requeue":
            self._requeue(job, tuple(event["pass"]), int(event["split"]), event["skip"])
        elif kind == "resume":
            self._resume(job, event)
        elif kind == "done":
            if tuple(event["pass"]) in job.passes:
                self._pass_done(job, tuple(event["pass"]), event["worker"])
            worker = self.workers.get(event["worker"])
            if worker is not None:
                worker.current = None
        elif kind == "epoch":
            job.epoch = max(job.epoch, int(event["epoch"]))
        elif kind == "pass":  # from a compacted journal
            key = tuple(event["pass"])
            job.passes[key] = Pass(
                deque(event["order"]), {w: list(s) for w, s in event["handed"].items()},
                deque(event["requeued"]), {w: list(s) for w, s in event["read"].items()},
                {int(split): skip for split, skip in event["skips"].items()})
            for split, origin in event["origins"]:
                job.origin_of[(key, int(split))] = tuple(origin)
        elif kind == "failed":
            job.error = event["error"]
            self._release_job(job, now)
        elif kind == "end":
            self._release_job(job, now)
            del self.jobs[job.id]

    def snapshot(self) -> list[dict[str, Any]]:
        """The journal events that rebuild the state as it is now (for compaction)."""
        events: list[dict[str, Any]] = [_worker_event(w) for w in self.workers.values()]
        for job in self.jobs.values():
            events.append(_job_event(job))
            if job.share is not None:
                events.append({"e": "share", "job": job.id, "share": job.share})
            if job.rounds is not None:
                events.append({"e": "rounds", "job": job.id, "size": job.rounds.size})
            events.append({"e": "epoch", "job": job.id, "epoch": job.epoch})
            if job.resume is not None:
                events.append({"e": "resume", "job": job.id, "epoch": job.resume[0],
                               "delivered": job.resume[1].to_json()})
            for task, worker in job.tasks.items():
                events.append({"e": "task", "job": job.id, "task": task, "worker": worker,
                               "index": job.indices[task]})
            for key, dispenser in job.passes.items():
                events.append({"e": "pass", "job": job.id, "pass": list(key),
                               "order": list(dispenser.order),
                               "requeued": list(dispenser.requeued),
                               "handed": dispenser.handed, "read": dispenser.read,
                               "skips": dispenser.skips,
                               "origins": [[split, list(origin)] for (k, split), origin
                                           in job.origin_of.items() if k == key]})
            if job.error is not None:
                events.append({"e": "failed", "job": job.id, "error": job.error})
        return events

    def _take(self, job: Job, worker_id: str, key: tuple[int, ...], split: int) -> None:
        """Replay one split handed to a worker."""
        dispenser = self._dispenser(job, key)
        for waiting in [dispenser, *(p for k, p in job.passes.items()
                                     if k[0] == key[0] and k != key)]:
            if split in waiting.requeued:
                waiting.requeued.remove(split)
                break
        else:
            if split in dispenser.order:
                dispenser.order.remove(split)
        dispenser.handed.setdefault(worker_id, []).append(split)
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.current = (key, split)

    # --- status ---------------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        """What ``zloader status --json`` prints; ``surplus`` marks the workers an actuator
        should drain (see :meth:`_surplus`)."""
        surplus = self._surplus(now)
        claims = self._claims(now)
        entitled = pool.shares(claims.values(), len(self.workers))
        workers = [{"worker": w.id, "host": w.host, "host_id": w.host_id, "pid": w.pid,
                    "endpoint": w.endpoint, "surplus": w.id in surplus,
                    "tasks": 1 if w.task else 0, "job": self._task_job(w.task),
                    "elements_per_second": round(w.rate, 1),
                    "elements": w.stats.get("elements", 0),
                    "cpu_seconds": w.stats.get("cpu_seconds", 0.0),
                    "rejected": w.stats.get("rejected", 0)}
                   for w in self.workers.values()]
        jobs = [{"job": j.id, "fingerprint": j.fingerprint, "name": j.name,
                 "sharding": j.sharding, "consumers": len(j.consumers), "workers": len(j.tasks),
                 "consumer_hosts": sorted(self._hosts(j)),
                 "elements": j.elements, "bytes": j.bytes, "shared": j.share is not None,
                 "starvation": round(j.starvation, 3), "desired_workers": j.desired,
                 "weight": j.weight, "share": round(entitled[j.id], 2),
                 "active": claims[j.id].wants > 0, "hungry": claims[j.id].hungry,
                 "stage_seconds": {k: round(v, 3) for k, v in j.stages.items()},
                 "trainers": self._trainers(j) if j.share is not None else [],
                 "rounds": _round_status(j.rounds, j.epoch) if j.rounds is not None else None,
                 "state": "failed" if j.error else "running"}
                for j in self.jobs.values()]
        return {"workers": workers, "jobs": jobs, "rejected": self.rejected}

    def metrics(self, now: float) -> dict[str, Any]:
        """A snapshot for ``zloader-broker --metrics-port`` (zloader/metrics.py); updates
        each job's starvation ratio over the time since the last snapshot."""
        self._sample(now)
        entitled = pool.shares(self._claims(now).values(), len(self.workers))
        jobs = []
        for job in self.jobs.values():
            jobs.append({"job": job.id, "name": job.name or "", "elements": job.elements,
                         "bytes": job.bytes, "wait_seconds": job.wait_seconds,
                         "starvation": job.starvation, "skipped": job.skipped,
                         "failed_splits": len(job.failed), "consumers": len(job.consumers),
                         "workers": len(job.tasks), "stages": dict(job.stages),
                         "desired_workers": job.desired, "weight": job.weight,
                         "share_workers": entitled[job.id]})
        workers = [{"worker": w.id, "host": w.host, "job": self._task_job(w.task) or "",
                    **{k: w.stats.get(k, 0) for k in ("elements", "bytes", "cpu_seconds",
                                                       "rejected", "credits", "ring_fill")}}
                   for w in self.workers.values()]
        return {"jobs": jobs, "workers": workers, "rejected": self.rejected}

    def _sample(self, now: float) -> None:
        """Each job's starvation over the time since the last sample (the share of it its
        consumers waited for data), and its autoscaler's ``desired_workers``."""
        for job in self.jobs.values():
            if job.waited_at is not None and now <= job.waited_at[1]:
                continue
            if job.waited_at is not None and job.consumers:
                job.starvation = min(1.0, max(0.0, (job.wait_seconds - job.waited_at[0])
                                              / ((now - job.waited_at[1])
                                                 * len(job.consumers))))
            job.waited_at = (job.wait_seconds, now)
            job.desired = self._desired(job, now)

    @staticmethod
    def _desired(job: Job, now: float) -> int:
        """The workers the job should have (zloader/autoscale.py); static and
        deterministic jobs keep the ones they have, and so does a job nobody reads."""
        if job.sharding == "static" or job.deterministic or not job.consumers:
            return len(job.tasks)
        desired = job.scaler.update(now, len(job.tasks), job.starvation)
        if desired != job.desired and job.desired:
            log.info("job %s: desired_workers %d -> %d (it has %d; consumers waited %.0f%% "
                     "of the time)", job.name or job.id, job.desired, desired, len(job.tasks),
                     100 * job.starvation)
        return desired

    @staticmethod
    def _deficit(job: Job) -> int:
        """Workers the job lacks for its ``desired_workers`` (negative: it has too many);
        0 before the autoscaler's first decision and for jobs that keep their workers."""
        if job.desired == 0 or job.sharding == "static" or job.deterministic:
            return 0
        return job.desired - len(job.tasks)

    def _hosts(self, job: Job) -> set[str]:
        return {c.host_id for cid in job.consumers if (c := self.consumers.get(cid))}

    def _surplus(self, now: float) -> set[str]:
        """Workers to drain: for each job with more than it wants, the excess, remote
        ones (no consumer of the job on their host) before local ones, the last assigned
        first; and workers idle for a cooldown while no job lacks any."""
        out: set[str] = set()
        for job in self.jobs.values():
            excess = -self._deficit(job)
            if excess <= 0:
                continue
            hosts = self._hosts(job)
            held = sorted(((self.workers[w], job.indices.get(t, 0))
                           for t, w in job.tasks.items() if w in self.workers),
                          key=lambda pair: (pair[0].host_id in hosts, -pair[1]))
            out.update(worker.id for worker, _ in held[:excess])
        if not any(self._deficit(j) > 0 for j in self.jobs.values()):
            out.update(w.id for w in self.workers.values()
                       if w.task is None and now - w.idle_since > self.cooldown)
        return out

    def _trainers(self, job: Job) -> list[dict[str, Any]]:
        """A shared job's trainers: pid, lag (elements produced that it has not been sent,
        the most over the job's workers) and elements skipped (summed)."""
        out = []
        for cid in sorted(job.consumers):
            consumer = self.consumers.get(cid)
            seen = [w.trainers[cid] for t in job.tasks.values()
                    if (w := self.workers.get(t)) is not None and cid in w.trainers]
            out.append({"consumer": cid, "pid": consumer.pid if consumer else None,
                        "lag": max((s.get("lag", 0) for s in seen), default=0),
                        "skipped": sum(s.get("skipped", 0) for s in seen)})
        return out


def _round_status(rounds: Rounds, epoch: int) -> dict[str, Any]:
    """A coordinated job's rounds for ``zloader status``: consumers, the current epoch's
    rounds numbered, rounds lost so far, indices waiting for a consumer."""
    return {"num_consumers": rounds.size, "epoch": epoch,
            "rounds": rounds.issued.get(epoch, 0), "lost": rounds.lost,
            "vacant": rounds.vacant()}


def _worker_event(worker: Worker) -> dict[str, Any]:
    return {"e": "worker", "id": worker.id, "host": worker.host, "host_id": worker.host_id,
            "pid": worker.pid, "endpoint": worker.endpoint, "prefer": worker.prefer,
            "plain_data": worker.plain_data}


def _job_event(job: Job) -> dict[str, Any]:
    return {"e": "job", "id": job.id, "fingerprint": job.fingerprint, "name": job.name,
            "options": job.options, "num_splits": job.num_splits,
            "shuffle_splits": job.shuffle_splits, "seed": job.seed, "width": job.width,
            "source_data": job.source_data, "entropy": job.entropy, "pipeline": job.pipeline}


def _skip(info: dict[str, Any]) -> dict[str, Any]:
    """What a worker skips in a split read again, from a consumer's :meth:`Ledger.info`."""
    have = info.get("have", "")
    skip: dict[str, Any] = {"skip": have if isinstance(have, str) else pack(have)}
    if info.get("expect") is not None:
        skip["expect"] = info["expect"]
    return skip


def _share(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError("REGISTER: share must be {window_bytes, lag, block_seconds}")
    size, lag, block = value.get("window_bytes"), value.get("lag"), value.get("block_seconds")
    if (isinstance(size, bool) or not isinstance(size, int) or size < 1
            or lag not in LAG_POLICIES or isinstance(block, bool)
            or not isinstance(block, (int, float)) or not block >= 0):
        raise ProtocolError(f"REGISTER: bad share settings {value!r}")
    return {"window_bytes": size, "lag": lag, "block_seconds": float(block)}


def _coordinated(value: Any, name: str | None) -> tuple[int, int] | None:
    """REGISTER's ``coordinated``: (num_consumers, consumer_index) or None."""
    if value is None:
        return None
    size = value.get("size") if isinstance(value, dict) else None
    index = value.get("index") if isinstance(value, dict) else None
    if (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 1 << 16
            or isinstance(index, bool) or not isinstance(index, int)
            or not 0 <= index < size):
        raise ProtocolError(f"REGISTER: coordinated must be {{size >= 1, 0 <= index < size}}, "
                            f"got {value!r}")
    if not name:
        raise ProtocolError("REGISTER: coordinated reads need a job_name")
    return size, index


def _weight(value: Any) -> float:
    """REGISTER.weight: a job's share of the pool relative to other jobs'."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.001 <= value <= 1000:
        raise ProtocolError("REGISTER: weight must be a number from 0.001 to 1000")
    return float(value)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 16:
        raise ProtocolError(f"REGISTER: balanced must be an int >= 0, got {value!r}")
    return value


def _source_data(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or not isinstance(value.get("endpoint"), str)
            or value.get("kind") not in ("arrays", "items")):
        raise ProtocolError("REGISTER: source_data must be {endpoint, kind: arrays|items}")
    return {"endpoint": value["endpoint"], "kind": value["kind"]}


INHERITED = {"inherited": True}
"""A job's ``pipeline`` when its Loader's forked workers hold it in memory (embedded)."""


def _holds(value: Any) -> frozenset[str]:
    """READY's ``holds``: the fingerprints of the pipelines a forked worker inherited."""
    if value is None:
        return frozenset()
    if not (isinstance(value, list) and len(value) <= 64
            and all(isinstance(v, str) and len(v) <= 128 for v in value)):
        raise ProtocolError("READY: holds must be a list of at most 64 fingerprints")
    return frozenset(value)


def _pipeline_ref(value: Any, blob: bytes) -> dict[str, Any] | None:
    """REGISTER's ``pipeline``: None (the pipeline is the payload), ``{inherited: true}``
    (embedded: the Loader's forked workers hold it) or ``{endpoint, sha256, bytes}`` (the
    Loader serves it; docs/protocol.md)."""
    if value is None:
        if not blob:
            raise ProtocolError("REGISTER: an empty pipeline payload and no 'pipeline' field")
        return None
    if value == INHERITED:
        return dict(INHERITED)
    if (isinstance(value, dict) and isinstance(value.get("endpoint"), str)
            and isinstance(value.get("sha256"), str) and len(value["sha256"]) == 64
            and isinstance(value.get("bytes"), int) and not isinstance(value["bytes"], bool)
            and value["bytes"] >= 0):
        return {"endpoint": value["endpoint"], "sha256": value["sha256"],
                "bytes": value["bytes"]}
    raise ProtocolError("REGISTER: pipeline must be {inherited: true} or "
                        "{endpoint, sha256, bytes}")


def _delta(new: dict[str, Any], old: dict[str, Any], key: str) -> Any:
    """How much counter ``key`` grew between two stats reports (0 if it went back)."""
    value, before = new.get(key), old.get(key, 0)
    if isinstance(value, (int, float)) and isinstance(before, (int, float)) \
            and not isinstance(value, bool) and value >= before:
        return value - before
    return 0
