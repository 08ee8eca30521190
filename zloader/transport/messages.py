"""One frozen record per message body of docs/protocol.md, with the checks that make it one.

:func:`zloader.transport.protocol.decode` parses frames into a :class:`Message` (version,
command, a JSON object within the size, depth and integer limits). :func:`decode` here turns
that message's body into the record of its command, checking every field the table in
docs/protocol.md gives it: its type, its range, its size and the shape of what it nests. A
body that is not one raises :class:`ProtocolError` naming the command and the field
(``"OPEN: field 'credits' must be an integer >= 0, got -1"``). Handlers take the record and
never look into the body themselves. :func:`encode` is the other way: a record's body, as
``protocol.encode`` frames it.

Each record lists its fields in wire order, declared with :func:`~zloader.transport.fields.fld`
(zloader/transport/fields.py holds the generic checks and the :class:`Record` base that
decodes and encodes, zloader/transport/shapes.py the checks of this protocol's nested
fields); the metadata of a field says how it is checked
(``check``), its name on the wire when that is not a Python name (``wire``: ``pass``) and
whether an absent or default value is left out of the body (``omit``): those fields are
optional on the wire and their absence means something (``DATA.origins``). A field with a
default may be missing from a body; one without may not.

``REGISTER.options`` and ``TASK.options`` decode into one
:class:`~zloader.options.JobOptions`, each of its fields checked (a bad one is refused as
``options.<field>``).

A few nested values are checked by the code that reads them, because it alone knows
their meaning: ``DATA.origins`` and ``END.origins`` (zloader/client/items.py, with the
record's buffers), ``JOB.rounds`` and ``JOB.joined`` (zloader/client/rounds.py),
``REGISTER.resume`` (a ledger, zloader/broker/jobs.py), the ``info`` of ``DELIVERED.splits`` and
``HEARTBEAT.reread`` (zloader/lineage/) and ``HEARTBEAT.stats`` (the broker keeps the
numbers >= 0); here they are checked to be JSON objects or lists. What needs the broker's
state (a ``job_name`` for coordinated reads, a payload or a pipeline reference) the broker
checks (zloader/broker/jobs.py).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zloader._defaults import MAX_AHEAD, MAX_BRANCHES, MAX_MIX_INPUTS, MAX_STAGES
from zloader.options import JobOptions
from zloader.transport import records
from zloader.transport.fields import (
    INDEX,
    MAX_NAME,
    NAME,
    PASS_KEY,
    Check,
    Record,
    Wrong,
    array,
    boolean,
    counts,
    fld,
    integer,
    is_int,
    list_of,
    number,
    obj,
    optional,
    packed,
    short,
    text,
)
from zloader.transport.notice import FRAME_HEAD, frame_size
from zloader.transport.protocol import HEARTBEAT_RANGE, Command, Message, ProtocolError
from zloader.transport.protocol import doing as lenient_doing
from zloader.transport.shapes import (
    HOLDS,
    MIX_PART,
    MIX_WEIGHTS,
    PIPELINE_REF,
    ROUNDS,
    drained_entry,
    endpoint,
    error_object,
    fence,
    handover_entry,
    job_worker,
    log_lines,
    shared_answer,
    source_info,
    source_ref,
    split_info,
    stuck_report,
)

__all__ = ["RECORDS", "Ack", "Branch", "Bye", "Close", "Commit", "ConsumerGone", "Credit", "Data",
           "Delivered", "Dispatch", "End", "Epoch", "Error", "Fail", "Fetch", "Handover",
           "Heartbeat", "Job", "Log", "Open", "PassDone", "Ready", "Received", "Record",
           "Register", "Release", "Ring", "Round", "RoundReq", "Source", "Split", "SplitReq",
           "Status", "Task", "TaskFailed", "Unknown", "Weighed", "Weights", "decode", "encode",
           "unframe"]

# --- records ------------------------------------------------------------------------------

# Worker and broker

@dataclass(kw_only=True, eq=False, repr=False)
class Ready(Record):
    """READY (worker): it (re-)registers with the broker."""

    COMMAND = Command.READY
    worker: str = fld(NAME)
    host: str = fld(text(255))
    host_id: str = fld(NAME)
    pid: int = fld(integer(0))
    endpoint: str = fld(endpoint)
    prefer: str | None = fld(optional(NAME), None)
    plain_data: bool = fld(boolean, False)
    holds: tuple[str, ...] | None = fld(optional(HOLDS), None, omit=True)
    slot: int | None = fld(optional(INDEX), None, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class Ack(Record):
    """ACK (broker): the answer to READY, with the task the broker runs on the worker."""

    COMMAND = Command.ACK
    heartbeat: float = fld(number(*HEARTBEAT_RANGE))
    task: str | None = fld(optional(NAME))  # null: the broker runs no task on this worker


@dataclass(kw_only=True, eq=False, repr=False)
class Task(Record):
    """TASK (broker): run this task of a job's pipeline."""

    COMMAND = Command.TASK
    task: str = fld(NAME)
    job: str = fld(NAME)
    options: JobOptions = fld(JobOptions.from_body)  # exactly_once: as the job runs it
    index: int = fld(INDEX)
    width: int = fld(INDEX)
    entropy: int = fld(integer())
    source_data: dict[str, Any] | None = fld(optional(source_ref), None)
    fingerprint: str | None = fld(optional(NAME), None)
    pipeline: dict[str, Any] | None = fld(PIPELINE_REF, None)
    # a shared job that takes branches (BRANCH): the first stage boundary one may part at
    first_tap: int = fld(integer(0, MAX_STAGES), 0, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class TaskFailed(Record):
    """TASK_FAILED (worker): the task's pipeline could not be loaded or raised."""

    COMMAND = Command.TASK_FAILED
    task: str = fld(NAME)
    error: dict[str, str] = fld(error_object)


@dataclass(kw_only=True, eq=False, repr=False)
class SplitReq(Record):
    """SPLIT_REQ (worker): the next split of a pass (and those ahead of it)."""

    COMMAND = Command.SPLIT_REQ
    task: str = fld(NAME)
    pass_: tuple[int, ...] = fld(PASS_KEY, wire="pass")
    have: int | None = fld(optional(INDEX), None)
    # the splits after the one asked for, wanted with it (answered in SPLIT.then)
    ahead: int = fld(integer(0, MAX_AHEAD), 0, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class Split(Record):
    """SPLIT (broker): a split of a pass for a task, or none left."""

    COMMAND = Command.SPLIT
    task: str = fld(NAME)
    pass_: tuple[int, ...] = fld(PASS_KEY, wire="pass")
    split: int | None = fld(optional(INDEX))
    have: int | None = fld(optional(INDEX), None)
    # exactly-once jobs only: where the split belongs, what to skip, what it held
    origin: tuple[int, ...] | None = fld(optional(PASS_KEY), None, omit=True)
    skip: str = fld(packed, "", omit=True)
    expect: tuple[int, ...] | None = fld(optional(list_of(integer(), 2, 2)), None, omit=True)
    # the groups anchored in it whose rows are to be made again (zloader/groups.py),
    # each [key, split, index, position, rows, members, rows held] (read by lineage/ledger.py)
    groups: list[Any] | None = fld(optional(array), None, omit=True)
    # the splits handed at the places after ``have``, in order, in one message: each of
    # this pass, read whole (no origin of its own, nothing to skip or expect)
    then: tuple[int, ...] = fld(list_of(INDEX, 0, MAX_AHEAD), (), omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class PassDone(Record):
    """PASS_DONE (worker): every split it was handed in a pass is read."""

    COMMAND = Command.PASS_DONE
    task: str = fld(NAME)
    pass_: tuple[int, ...] = fld(PASS_KEY, wire="pass")


@dataclass(kw_only=True, eq=False, repr=False)
class Weighed(Record):
    """WEIGHED (worker): a shared job's mix draws pass ``pass`` with ``weights`` from its
    draw number ``at`` on (zloader/mixing.py ``Switches``); the broker sends it back once
    noted, and the worker draws nothing with them before."""

    COMMAND = Command.WEIGHED
    task: str = fld(NAME)
    pass_: tuple[int, ...] = fld(PASS_KEY, wire="pass")
    at: int = fld(INDEX)
    weights: tuple[float, ...] = fld(MIX_WEIGHTS)


@dataclass(kw_only=True, eq=False, repr=False)
class Release(Record):
    """RELEASE (broker): stop the task (or drain it first)."""

    COMMAND = Command.RELEASE
    task: str = fld(NAME)
    # finish the splits taken, send what they make, then say so (HEARTBEAT.drained)
    drain: bool = fld(boolean, False, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class Branch(Record):
    """A shared job's trainers whose pipeline shares the source and first ``tap``
    stages with the job's (zloader/sharing/branches.py): they read branch ``branch``; the
    pipeline is the payload, or where ``pipeline`` says."""

    COMMAND = Command.BRANCH
    task: str = fld(NAME)
    branch: int = fld(integer(1, MAX_BRANCHES))
    tap: int = fld(integer(1, MAX_STAGES))
    fingerprint: str = fld(NAME)
    pipeline: dict[str, Any] | None = fld(PIPELINE_REF, None, omit=True)
    source_data: dict[str, Any] | None = fld(optional(source_ref), None, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class Handover(Record):
    """HANDOVER (broker): a shared job's splits another worker read, to make again."""

    COMMAND = Command.HANDOVER
    task: str = fld(NAME)
    segments: tuple[dict[str, Any], ...] = fld(list_of(handover_entry))
    # epochs whose END the worker holds back: a dead worker's fence waits for its trainers
    held: tuple[int, ...] = fld(list_of(INDEX), (), omit=True)
    # the fence whose dead worker's splits these are, or the drained task whose: the END
    # of each trainer it makes them again for names it
    fence: str | None = fld(optional(NAME), None, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class ConsumerGone(Record):
    """CONSUMER_GONE (broker): a consumer of the task's job left."""

    COMMAND = Command.CONSUMER_GONE
    task: str | None = fld(optional(NAME), None)
    consumer: str = fld(NAME)
    replaced: bool = fld(boolean, False)


@dataclass(kw_only=True, eq=False, repr=False)
class RoundReq(Record):
    """ROUND_REQ (worker): a coordinated job's next round number."""

    COMMAND = Command.ROUND_REQ
    task: str = fld(NAME)
    epoch: int = fld(INDEX)
    # consumer ids by index (null: a vacant index, which no round is numbered for)
    members: tuple[str | None, ...] = fld(list_of(optional(NAME), 1))


@dataclass(kw_only=True, eq=False, repr=False)
class Round(Record):
    """ROUND (broker): a coordinated job's round number."""

    COMMAND = Command.ROUND
    task: str = fld(NAME)
    epoch: int = fld(INDEX)
    round: int | None = fld(optional(INDEX))


# Consumer and broker

@dataclass(kw_only=True, eq=False, repr=False)
class Register(Record):
    """REGISTER (consumer): join a job (made from the pipeline when new)."""

    COMMAND = Command.REGISTER
    consumer: str = fld(NAME)
    fingerprint: str = fld(NAME)
    job_name: str | None = fld(optional(NAME))
    options: JobOptions = fld(JobOptions.from_body)
    source: dict[str, Any] = fld(source_info)
    host_id: str = fld(NAME)
    pid: int = fld(INDEX)
    # a coordinated consumer's index, 0 <= consumer_index < options.num_consumers
    consumer_index: int | None = fld(optional(INDEX), None, omit=True)
    pipeline: dict[str, Any] | None = fld(PIPELINE_REF, None, omit=True)
    source_data: dict[str, Any] | None = fld(optional(source_ref), None, omit=True)
    resume: dict[str, Any] | None = fld(optional(obj), None, omit=True)
    entropy: int | None = fld(optional(integer()), None, omit=True)
    job: str | None = fld(optional(NAME), None, omit=True)  # the job it had, registering again
    # A shared job's: the fingerprint of the source and each prefix of the worker part's
    # stages (``[i]``: the source and ``i`` stages), the fewest stages a shared prefix may
    # hold (after every repeat), and the stages' names (zloader status)
    prefixes: tuple[str, ...] = fld(list_of(NAME, 0, MAX_STAGES + 1), (), omit=True)
    first_tap: int = fld(integer(1, MAX_STAGES), 1, omit=True)
    stage_names: tuple[str, ...] = fld(list_of(text(128), 0, MAX_STAGES), (), omit=True)
    # The pipeline (cloudpickle; empty when ``pipeline`` says where it is): the message's
    # payload frame, not a field of the body (:func:`decode` sets it).
    blob: bytes = dataclasses.field(default=b"", repr=False, compare=False)


@dataclass(kw_only=True, eq=False, repr=False)
class Job(Record):
    """JOB (broker): a job and its workers, as a consumer sees them."""

    COMMAND = Command.JOB
    job: str = fld(NAME)
    workers: tuple[dict[str, Any], ...] = fld(list_of(job_worker))
    failed: tuple[Any, ...] = fld(list_of(obj), ())
    error: dict[str, str] | None = fld(optional(error_object), None)
    heartbeat: float | None = fld(optional(number(*HEARTBEAT_RANGE)), None)
    consumers: int | None = fld(optional(INDEX), None)
    busy_elsewhere: int = fld(INDEX, 0)
    pending: dict[str, int] = fld(counts, None)
    share: dict[str, Any] | None = fld(optional(obj), None)
    epoch: int | None = fld(optional(integer()), None)
    width: int | None = fld(optional(INDEX), None)
    entropy: int | None = fld(optional(integer()), None)
    stages: dict[str, Any] | None = fld(optional(obj), None)
    state: str = fld(text(64), "running")
    rounds: dict[str, Any] | None = fld(optional(obj), None, omit=True)
    fences: tuple[dict[str, Any], ...] = fld(list_of(fence), (), omit=True)
    fencing: dict[str, int] | None = fld(optional(counts), None, omit=True)
    joined: dict[str, Any] | None = fld(optional(obj), None, omit=True)
    read: tuple[Any, ...] | None = fld(optional(array), None, omit=True)
    # its latest tasks that left it cleanly (drained, SIGTERM): each sent its END last
    drained: tuple[dict[str, Any], ...] = fld(list_of(drained_entry), (), omit=True)
    # a shared job's trainer: the branch it reads (its OPEN says so), 0: the job's pipeline
    branch: int = fld(integer(0, MAX_BRANCHES), 0, omit=True)

    def __post_init__(self) -> None:
        if self.pending is None:
            object.__setattr__(self, "pending", {})


@dataclass(kw_only=True, eq=False, repr=False)
class Epoch(Record):
    """EPOCH (consumer): it starts an epoch."""

    COMMAND = Command.EPOCH
    job: str | None = fld(optional(NAME), None)  # null: the consumer's job is not known yet
    epoch: int | None = fld(optional(INDEX))


@dataclass(kw_only=True, eq=False, repr=False)
class Received(Record):
    """RECEIVED (consumer): a coordinated job's rounds it has."""

    COMMAND = Command.RECEIVED
    epoch: int = fld(INDEX)
    rounds: tuple[int, ...] = fld(ROUNDS)


@dataclass(kw_only=True, eq=False, repr=False)
class Commit(Record):
    """COMMIT (broker): a coordinated job's rounds every consumer has."""

    COMMAND = Command.COMMIT
    epoch: int = fld(INDEX)
    rounds: tuple[int, ...] = fld(ROUNDS)
    lost: tuple[int, ...] = fld(ROUNDS, ())
    total_lost: int = fld(INDEX, 0)


@dataclass(kw_only=True, eq=False, repr=False)
class Delivered(Record):
    """DELIVERED (consumer): what it holds of a dead worker's splits."""

    COMMAND = Command.DELIVERED
    job: str = fld(NAME)
    fence: str = fld(NAME)
    splits: tuple[tuple[tuple[int, ...], int, dict[str, Any]], ...] = fld(list_of(split_info))
    # a shared job's consumer: its epoch, whether it is over, and the elements it got from
    # the fence's worker in it
    shared: dict[str, Any] | None = fld(optional(shared_answer), None, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class Log(Record):
    """A worker's (``task``) or the broker's (``host``, ``pid``) LOG."""

    COMMAND = Command.LOG
    lines: tuple[tuple[int, str], ...] = fld(log_lines)
    task: str | None = fld(optional(NAME), None, omit=True)
    host: str | None = fld(optional(text(255)), None, omit=True)
    pid: int | None = fld(optional(INDEX), None, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class Bye(Record):
    """BYE (worker or consumer): it leaves. A consumer of an exactly-once job that leaves
    in the middle of an epoch, or after its part of one, says what it yielded of it
    (``left``: ``{epoch, delivered}`` as ``Loader.state_dict()`` has them), so that the
    broker reads none of it again for the job's other consumers when a worker dies later."""

    COMMAND = Command.BYE
    left: dict[str, Any] | None = fld(optional(obj), None, omit=True)


# Anyone and broker

@dataclass(kw_only=True, eq=False, repr=False)
class Heartbeat(Record):
    """HEARTBEAT (any): alive, with counters."""

    COMMAND = Command.HEARTBEAT
    stats: dict[str, Any] | None = fld(optional(obj), None, omit=True)
    # a malformed ``doing`` reads as absent (docs/protocol.md: it is ignored)
    doing: dict[str, Any] | None = fld(lenient_doing, None, omit=True)
    stuck: tuple[dict[str, Any], ...] = fld(list_of(stuck_report), (), omit=True)
    reread: tuple[tuple[tuple[int, ...], int, dict[str, Any]], ...] = fld(
        list_of(split_info), (), omit=True)
    # a worker told to drain its task (RELEASE.drain) is done with it
    drained: str | None = fld(optional(NAME), None, omit=True)
    # and, a shared job's, the splits it read for trainers that start those epochs later
    handover: tuple[dict[str, Any], ...] = fld(list_of(handover_entry), (), omit=True)
    # a worker draining to leave (SIGTERM): a shared job's other workers hold the epochs
    # it read until its handover comes
    leaving: bool = fld(boolean, False, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class Status(Record):
    """A STATUS request (empty) or the broker's answer: ``workers``, ``jobs`` and the
    broker's own counters, passed on as they are (``zloader status --json``)."""

    COMMAND = Command.STATUS
    report: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def spec(cls) -> tuple[tuple[str, str, Check, Any, bool], ...]:
        return ()  # the answer's fields are the broker's status, passed on whole

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Status:
        for name in ("workers", "jobs"):
            if name in body and not isinstance(body[name], list):
                raise ProtocolError(f"STATUS: field {name!r} must be a list, got "
                                    f"{short(body[name])}")
        return cls(report=dict(body))

    def to_body(self) -> dict[str, Any]:
        return dict(self.report)


@dataclass(kw_only=True, eq=False, repr=False)
class Unknown(Record):
    """UNKNOWN (broker): the sender is not known (a broker restart): register again."""

    COMMAND = Command.UNKNOWN
    reason: str = fld(text(1 << 16), "")


@dataclass(kw_only=True, eq=False, repr=False)
class Error(Record):
    """ERROR (broker, worker): a message was refused."""

    COMMAND = Command.ERROR
    message: str = fld(text(1 << 16), "the peer refused the request")


# Data path

@dataclass(kw_only=True, eq=False, repr=False)
class Open(Record):
    """OPEN (consumer): open an epoch's stream on a worker."""

    COMMAND = Command.OPEN
    job: str = fld(NAME)
    task: str | None = fld(optional(NAME), None)
    consumer: str = fld(NAME)
    epoch: int = fld(INDEX)
    credits: int = fld(INDEX)
    rerun: int = fld(INDEX, 0)
    ring: str | None = fld(optional(NAME), None)
    consumer_index: int | None = fld(optional(INDEX), None, omit=True)
    # The consumer's notice pipe and the ring's id in its notices (transport/notice.py).
    notify: str | None = fld(optional(NAME), None, omit=True)
    ring_id: int | None = fld(optional(INDEX), None, omit=True)
    # The bytes of records this worker may have in flight to the consumer (its share of
    # the consumer's memory budget, client/budget.py); absent: no bound but the credits.
    window: int | None = fld(optional(INDEX), None, omit=True)
    # A mix's weights set on the consumer's Loader (Loader.set_weights); absent: its own;
    # and when they were set (of a job's consumers' weights, the last set win)
    weights: tuple[float, ...] | None = fld(optional(MIX_WEIGHTS), None, omit=True)
    weights_stamp: float = fld(number(0.0, 1e12), 0.0, omit=True)
    # A shared job's trainer opening again the epoch it was reading (the broker had given
    # up on it): the elements of it this worker had sent it (its cursor may be forgotten)
    had: int = fld(INDEX, 0, omit=True)
    # A shared job's trainer whose pipeline shares a prefix with the job's: its branch
    # (JOB.branch; 0: the job's own pipeline)
    branch: int = fld(integer(0, MAX_BRANCHES), 0, omit=True)
    # The epoch's work items (DISPATCH) follow again, from the first the consumer has not
    # received: those the worker holds are dropped (its stream of them was lost)
    redispatched: bool = fld(boolean, False, omit=True)
    # This OPEN's number (1 to 2**32 - 1) in the ring's header: the consumer gives the
    # credits of this stream back there too (transport/ring.py), once the worker says it
    # takes them; absent: CREDIT messages only
    counter: int | None = fld(optional(integer(1, 2**32 - 1)), None, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class Weights(Record):
    """WEIGHTS (consumer): a mix's weights from now on."""

    COMMAND = Command.WEIGHTS
    weights: tuple[float, ...] = fld(MIX_WEIGHTS)
    stamp: float = fld(number(0.0, 1e12), 0.0, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class Dispatch(Record):
    """DISPATCH (consumer): work items for a dispatched source's epoch."""

    COMMAND = Command.DISPATCH
    epoch: int = fld(INDEX)
    items: tuple[int, ...] = fld(list_of(INDEX))
    # credits for the epoch's records, as a CREDIT would give them (the consumer of a
    # source whose items make one record each sends them with its next items)
    credits: int = fld(INDEX, 0, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class Credit(Record):
    """CREDIT (consumer): records it has room for."""

    COMMAND = Command.CREDIT
    epoch: int = fld(INDEX)
    credits: int = fld(INDEX)
    mapped: tuple[str, ...] = fld(list_of(NAME), ())
    # The mix input they are for, in a job whose consumers draw the mix (each input has
    # credits of its own); absent: for each input (OPEN's are), or the job has no parts.
    part: int | None = fld(optional(MIX_PART), None, omit=True)


def _ring_place(value: Any) -> tuple[int, int, str]:
    """``DATA.ring``: ``[position, length, ring name]``."""
    if not (isinstance(value, list) and len(value) == 3 and is_int(value[0])
            and value[0] >= 0 and is_int(value[1]) and value[1] >= 0
            and isinstance(value[2], str) and len(value[2]) <= MAX_NAME):
        raise Wrong("must be [position, length, ring name]")
    return value[0], value[1], value[2]


def _segment(value: Any) -> tuple[str, int]:
    """``DATA.segment``: ``[name, length]``."""
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and len(value[0]) <= MAX_NAME and is_int(value[1]) and value[1] >= 0):
        raise Wrong("must be [segment name, length]")
    return value[0], value[1]


@dataclass(kw_only=True, eq=False, repr=False)
class Data(Record):
    """One record's notice: the data path's one message per record, so its body is not
    JSON but a packed struct (:data:`~zloader.transport.protocol.PACKED`): the fields
    below, little-endian, as :meth:`to_body` writes them and :meth:`from_body` checks
    them (docs/protocol.md gives the layout)."""

    COMMAND = Command.DATA
    epoch: int = fld(INDEX)
    count: int = fld(INDEX)
    skipped: int = fld(INDEX, 0)
    ring: tuple[int, int, str] | None = fld(optional(_ring_place), None)
    segment: tuple[str, int] | None = fld(optional(_segment), None, omit=True)
    full: bool = fld(boolean, False, omit=True)
    shared: bool = fld(boolean, False, omit=True)
    lagged: int | None = fld(optional(INDEX), None, omit=True)
    round: int | None = fld(optional(INDEX), None, omit=True)
    origins: bool = fld(boolean, False, omit=True)  # the last buffer is an origin block
    # The ring record is framed (transport/notice.py): its own DATA body comes first.
    framed: bool = fld(boolean, False, omit=True)
    # A framed record's notice follows this many DATA messages of its epoch (notice.py).
    after: int | None = fld(optional(INDEX), None, omit=True)
    # The mix input whose elements it holds, in a job whose consumers draw the mix
    # (zloader/plan.py); absent otherwise.
    part: int | None = fld(optional(MIX_PART), None, omit=True)
    # A shared job's record: the place of its first element in what the worker makes of
    # the epoch for this consumer's branch (what a trainer has of a dead worker's, by
    # place: DELIVERED.shared.ranges); absent for what it makes of another's splits.
    first: int | None = fld(optional(INDEX), None, omit=True)

    @classmethod
    def from_body(cls, body: Any) -> Data:
        """The record a packed DATA body holds.

        Raises:
            ProtocolError: the body is not one (the message says which part is wrong).
        """
        raw = bytes(body) if not isinstance(body, bytes) else body
        if len(raw) < _DATA_HEAD.size:
            raise ProtocolError(f"DATA: body of {len(raw)} bytes, a packed DATA has at "
                                f"least {_DATA_HEAD.size}")
        epoch, count, skipped, flags = _DATA_HEAD.unpack_from(raw)
        if flags & ~_DATA_FLAGS_ALL:
            raise ProtocolError(f"DATA: field 'flags' has unknown bits {flags:#x}")
        at = _DATA_HEAD.size
        values: dict[str, Any] = {
            "epoch": epoch, "count": count, "skipped": skipped, "ring": None, "segment": None,
            "full": bool(flags & _FULL), "shared": bool(flags & _SHARED), "lagged": None,
            "round": None, "origins": bool(flags & _ORIGINS), "framed": bool(flags & _FRAMED),
            "after": None, "part": None, "first": None}
        try:
            if flags & _RING:
                position, length, size = _DATA_PLACE.unpack_from(raw, at)
                at += _DATA_PLACE.size
                values["ring"] = (position, length, _name(raw, at, size, "ring"))
                at += size
            if flags & _SEGMENT:
                length, size = _DATA_NAMED.unpack_from(raw, at)
                at += _DATA_NAMED.size
                values["segment"] = (_name(raw, at, size, "segment"), length)
                at += size
            for flag, name in ((_LAGGED, "lagged"), (_ROUND, "round"), (_AFTER, "after"),
                               (_PART, "part"), (_FIRST, "first")):
                if flags & flag:
                    values[name] = _DATA_INT.unpack_from(raw, at)[0]
                    at += _DATA_INT.size
        except struct.error:
            raise ProtocolError(f"DATA: body of {len(raw)} bytes ends inside its fields "
                                f"(flags {flags:#x})") from None
        if at != len(raw):
            raise ProtocolError(f"DATA: {len(raw) - at} bytes after its fields")
        if values["part"] is not None and values["part"] >= MAX_MIX_INPUTS:
            raise ProtocolError(f"DATA: field 'part' must be an integer >= 0 <= "
                                f"{MAX_MIX_INPUTS - 1}, got {values['part']}")
        return cls.checked(values)

    @staticmethod
    def epoch_of(body: Any) -> int | None:
        """The epoch a packed DATA body names, if it is long enough to name one."""
        if isinstance(body, bytes) and len(body) >= 8:
            return int.from_bytes(body[:8], "little")
        return None

    def to_body(self) -> bytes:  # type: ignore[override]
        """The packed body of this record."""
        flags = ((_RING if self.ring is not None else 0)
                 | (_SEGMENT if self.segment is not None else 0)
                 | (_FULL if self.full else 0) | (_SHARED if self.shared else 0)
                 | (_LAGGED if self.lagged is not None else 0)
                 | (_ROUND if self.round is not None else 0)
                 | (_ORIGINS if self.origins else 0) | (_FRAMED if self.framed else 0)
                 | (_AFTER if self.after is not None else 0)
                 | (_PART if self.part is not None else 0)
                 | (_FIRST if self.first is not None else 0))
        parts = [_DATA_HEAD.pack(self.epoch, self.count, self.skipped, flags)]
        if self.ring is not None:
            name = self.ring[2].encode()
            parts += [_DATA_PLACE.pack(self.ring[0], self.ring[1], len(name)), name]
        if self.segment is not None:
            name = self.segment[0].encode()
            parts += [_DATA_NAMED.pack(self.segment[1], len(name)), name]
        for value in (self.lagged, self.round, self.after, self.part, self.first):
            if value is not None:
                parts.append(_DATA_INT.pack(value))
        return b"".join(parts)


_DATA_HEAD = struct.Struct("<QQQH")  # epoch, count, skipped, flags
_DATA_PLACE = struct.Struct("<QQH")  # ring: position, length, name length (name follows)
_DATA_NAMED = struct.Struct("<QH")  # segment: length, name length (name follows)
_DATA_INT = struct.Struct("<Q")  # lagged, round, after, part, first
_RING, _SEGMENT, _FULL, _SHARED, _LAGGED, _ROUND, _ORIGINS, _FRAMED, _AFTER, _PART, _FIRST = (
    1 << i for i in range(11))
_DATA_FLAGS_ALL = (1 << 11) - 1


def unframe(block: Any) -> tuple[Data, list[Any]]:
    """The DATA body and the buffers of a framed ring record (transport/notice.py), the
    buffers as views of ``block``. The compiled core's twin reads the usual ones in C
    (zloader/client/receive.py picks it) and hands any other to this function.

    Raises:
        ProtocolError: it is not one.
        CodecError: its buffers are not packed right.
    """
    length = len(block)
    if length < FRAME_HEAD.size:
        raise ProtocolError(f"framed record of {length} bytes")
    size, _ = FRAME_HEAD.unpack_from(block, 0)
    start, _ = frame_size(size, 0)
    if start > length:
        raise ProtocolError(f"framed record of {length} bytes with a body of {size}")
    data = Data.from_body(bytes(block[FRAME_HEAD.size:FRAME_HEAD.size + size]))
    if data.ring is not None or data.segment is not None or data.framed:
        raise ProtocolError("a framed record's body names a place of its own")
    return data, records.unpack(memoryview(block[start:]))


def _name(raw: bytes, at: int, size: int, field: str) -> str:
    """A shared-memory name inside a packed body."""
    if size > MAX_NAME or at + size > len(raw):
        raise ProtocolError(f"DATA: field {field!r} has a name of {size} bytes (at most "
                            f"{MAX_NAME}, within the body)")
    try:
        return raw[at:at + size].decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError(f"DATA: field {field!r} has a name that is not ASCII") from None


@dataclass(kw_only=True, eq=False, repr=False)
class End(Record):
    """END (worker): the epoch's stream ended."""

    COMMAND = Command.END
    epoch: int = fld(INDEX)
    skipped: int = fld(INDEX, 0)
    dropped: int | None = fld(optional(INDEX), None, omit=True)
    rerun: int | None = fld(optional(INDEX), None, omit=True)
    lagged: int | None = fld(optional(INDEX), None, omit=True)
    replayed: int | None = fld(optional(INDEX), None, omit=True)
    # a shared job's: the fences (or drained tasks) whose elements came before it (HANDOVER)
    fences: tuple[str, ...] = fld(list_of(NAME), (), omit=True)
    # a shared job's task that handed its splits of the epoch on (the taker's END names it)
    handed: str | None = fld(optional(NAME), None, omit=True)
    origins: bool = fld(boolean, False, omit=True)  # an origin block is its payload
    # A mix input the worker has no more elements of this epoch (its consumers draw the
    # mix, zloader/plan.py): not the epoch's end, which has no part.
    part: int | None = fld(optional(MIX_PART), None, omit=True)


@dataclass(kw_only=True, eq=False, repr=False)
class Fail(Record):
    """FAIL (worker): the epoch's stream failed."""

    COMMAND = Command.FAIL
    epoch: int = fld(INDEX)
    error: dict[str, str] = fld(error_object)


@dataclass(kw_only=True, eq=False, repr=False)
class Ring(Record):
    """RING (consumer): the shared-memory ring to write records into."""

    COMMAND = Command.RING
    ring: str = fld(NAME)
    ring_id: int | None = fld(optional(INDEX), None, omit=True)  # its id in notices


@dataclass(kw_only=True, eq=False, repr=False)
class Close(Record):
    """CLOSE (consumer): close the stream."""

    COMMAND = Command.CLOSE


# Source data

@dataclass(kw_only=True, eq=False, repr=False)
class Fetch(Record):
    """FETCH (worker): a piece of the consumer's source data."""

    COMMAND = Command.FETCH
    what: str = fld(text(choices=("pipeline", "source")), "source")


@dataclass(kw_only=True, eq=False, repr=False)
class Source(Record):
    """SOURCE (consumer): the answer to FETCH."""

    COMMAND = Command.SOURCE
    kind: str = fld(text(choices=("pipeline", "arrays", "items")))


RECORDS: dict[Command, type[Record]] = {
    cls.COMMAND: cls for cls in (
        Ready, Ack, Task, TaskFailed, SplitReq, Split, PassDone, Weighed, Release, Handover,
        Branch, ConsumerGone,
        RoundReq, Round, Register, Job, Epoch, Received, Commit, Delivered, Log, Bye,
        Heartbeat, Status, Unknown, Error, Open, Credit, Weights, Dispatch, Data, End, Fail,
        Ring, Close, Fetch, Source)}
"""The record of each command's body."""


def decode(msg: Message) -> Record:
    """The record of ``msg``'s body, every field checked.

    Raises:
        ProtocolError: the body is not one of its command (the message names the command
            and the field).
    """
    record = RECORDS[msg.command].from_body(msg.body)
    if isinstance(record, Register):
        record = dataclasses.replace(record, blob=bytes(msg.payload[0]) if msg.payload else b"")
    return record


def encode(record: Record) -> dict[str, Any]:
    """The body of ``record`` (frame it with ``protocol.encode(record.COMMAND, ...)``)."""
    return record.to_body()
