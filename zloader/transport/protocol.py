"""Message framing for docs/protocol.md: version frame, command, JSON body, payloads.

Every message is ``[version, command, body, *payload]`` (a ROUTER socket adds and removes
the peer identity in front). ``encode``/``decode`` are the only places that build or parse
frames; everything that comes from a peer is checked here and malformed input raises
:class:`ProtocolError`, which receivers log and drop.
"""

from __future__ import annotations

import enum
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from zloader._byfields import ByFields
from zloader._defaults import (
    HEARTBEAT_RANGE,
    MAX_BODY_BYTES,
    MAX_BODY_DEPTH,
    MAX_REGISTER_BODY_BYTES,
    STAGES,
)
from zloader.errors import ZloaderError

__all__ = ["PACKED", "VERSION", "Command", "Message", "ProtocolError", "VersionMismatch", "decode",
           "encode"]

VERSION = (f"ZLP/11 py/{sys.version_info[0]}.{sys.version_info[1]} "
           f"cp/{cloudpickle.__version__}").encode("ascii")
"""The version frame: protocol version, Python minor version, cloudpickle version."""

MAX_BODY_INT = 1 << 64
"""Integers in a body lie in (-2**64, 2**64): seeds and digests are 64-bit, every other
field is smaller; wider ones (thousands of digits) are refused before anything computes
with them."""


class Command(enum.IntEnum):
    """Command byte of every message (docs/protocol.md lists who sends each)."""

    READY = 1          # worker -> broker: register
    ACK = 2            # broker -> worker: registered
    TASK = 3           # broker -> worker: run a job (payload: pipeline)
    TASK_FAILED = 4    # worker -> broker: the task could not start
    SPLIT_REQ = 5      # worker -> broker: next split of a pass
    SPLIT = 6          # broker -> worker: a split, or none left
    PASS_DONE = 7      # worker -> broker: finished every split it took in a pass
    RELEASE = 8        # broker -> worker: the task is over
    CONSUMER_GONE = 9  # broker -> worker: a consumer left
    REGISTER = 10      # consumer -> broker: join or create a job (payload: pipeline)
    JOB = 11           # broker -> consumer: the job and its workers
    EPOCH = 12         # consumer -> broker: starting an epoch
    BYE = 13           # worker/consumer -> broker: leaving
    HEARTBEAT = 14     # anyone: liveness
    STATUS = 15        # anyone <-> broker: service status
    UNKNOWN = 16       # broker -> peer: you are not registered
    ERROR = 17         # broker/worker -> peer: refused, with a message
    OPEN = 20          # consumer -> worker: start receiving an epoch
    CREDIT = 21        # consumer -> worker: more credits
    DATA = 22          # worker -> consumer: one record
    END = 23           # worker -> consumer: no more data for an epoch
    FAIL = 24          # worker -> consumer: user code failed
    CLOSE = 25         # consumer -> worker: leaving
    RING = 26          # consumer -> worker: write into this (larger) ring from now on
    WEIGHTS = 27       # consumer -> worker: a mix's weights from now on
    DISPATCH = 28      # consumer -> worker: work items of an epoch, as they are due
    FETCH = 30         # worker -> consumer: send the job's in-memory source data
    SOURCE = 31        # consumer -> worker: the source data (payload)
    ROUND_REQ = 40     # worker -> broker: number my next round (coordinated reads)
    ROUND = 41         # broker -> worker: the round's number, or none
    RECEIVED = 42      # consumer -> broker: I received my elements of these rounds
    COMMIT = 43        # broker -> consumer: these rounds are committed, those lost
    DELIVERED = 44     # consumer -> broker: what I hold of a dead worker's splits
    HANDOVER = 45      # broker -> worker: a moved worker's splits of a shared job, to make again
    BRANCH = 46        # broker -> worker: a shared job's trainers of another pipeline (payload)
    WEIGHED = 47       # worker <-> broker: a shared job's mix took new weights (echoed: noted)
    LOG = 50           # worker -> broker -> consumer: what user code printed or logged


PACKED = frozenset({Command.DATA})
"""Commands whose body is a packed struct, not JSON (zloader/transport/messages.py gives
its layout and checks it): DATA goes once per record, and the data path's cost per record
is what bounds small elements."""


_COMMANDS = {int(command): command for command in Command}  # (faster than Command(byte))


class ProtocolError(ZloaderError):
    """A malformed message; receivers log it and drop it."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol, Python or cloudpickle version."""

    def __init__(self, theirs: bytes) -> None:
        self.theirs = theirs
        super().__init__(
            f"protocol mismatch: this side speaks {VERSION.decode()!r}, the peer sent "
            f"{theirs.decode('ascii', 'replace')!r}; run the same zloader, Python minor "
            "version and cloudpickle version on every host")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.theirs,)


@dataclass(eq=False, repr=False)
class Message(ByFields):
    """One decoded message. ``payload`` holds frames (bytes-like) after the body; the body
    is read through its record (zloader/transport/messages.py: ``decode``), never by hand."""

    command: Command
    body: Any = field(default_factory=dict)  # a dict; bytes for a PACKED command
    payload: list[Any] = field(default_factory=list)


def heartbeat(value: Any) -> float | None:
    """A heartbeat interval the broker announced (ACK, JOB), or None if it is not one."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and HEARTBEAT_RANGE[0] <= value <= HEARTBEAT_RANGE[1]:
        return float(value)
    return None


def doing(value: Any) -> dict[str, Any] | None:
    """A worker's ``HEARTBEAT.doing`` (passed on in ``JOB.workers[].doing``):
    ``{epoch, split, stage}`` checked, or None if it is not one."""
    if not isinstance(value, dict) or value.get("stage") not in STAGES:
        return None
    epoch, split = value.get("epoch"), value.get("split")
    if not (isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0):
        return None
    if split is not None and not (isinstance(split, int) and not isinstance(split, bool)
                                  and split >= 0):
        return None
    return {"epoch": epoch, "split": split, "stage": value["stage"]}


def doing_text(value: dict[str, Any]) -> str:
    """``stage S of split N, epoch E``: a checked :func:`doing`, for error messages."""
    split = f"split {value['split']}" if value.get("split") is not None else "no split yet"
    return f"stage {value['stage']!r} of {split}, epoch {value['epoch']}"


def encode(command: Command, body: dict[str, Any] | bytes | None = None,
           payload: Sequence[Any] = ()) -> list[Any]:
    """The frames of one message (without a ROUTER identity); ``body``: a JSON object, or
    the packed body of a :data:`PACKED` command."""
    data = body if isinstance(body, bytes) else json.dumps(body or {},
                                                           separators=(",", ":")).encode()
    return [VERSION, bytes((command,)), data, *payload]


def decode(frames: Sequence[Any]) -> Message:
    """Parse the frames of one message (without a ROUTER identity).

    Anything a peer sends may be hostile: every failure to parse it, whatever its kind
    (deep nesting that exhausts the parser's recursion, an integer of thousands of digits,
    a frame object that is not a buffer), comes out as :class:`ProtocolError`.

    Raises:
        VersionMismatch: the version frame differs from ours.
        ProtocolError: any other malformation.
    """
    try:
        return _decode(frames)
    except ProtocolError:
        raise
    except Exception as exc:  # RecursionError, MemoryError, TypeError...: still malformed
        raise ProtocolError(f"undecodable message ({type(exc).__name__}: "
                            f"{str(exc)[:200]})") from None


def _decode(frames: Sequence[Any]) -> Message:
    if len(frames) < 3:
        raise ProtocolError(f"message has {len(frames)} frames, needs at least 3")
    version = _bytes(frames[0])
    if version != VERSION:
        if not version.startswith(b"ZLP/"):
            raise ProtocolError("first frame is not a zloader protocol version")
        raise VersionMismatch(version)
    command_frame = _bytes(frames[1])
    if len(command_frame) != 1:
        raise ProtocolError(f"command frame has {len(command_frame)} bytes, needs 1")
    command = _COMMANDS.get(command_frame[0])
    if command is None:
        raise ProtocolError(f"unknown command {command_frame[0]}")
    raw = _bytes(frames[2])
    if command in PACKED:
        if len(raw) > MAX_BODY_BYTES:
            raise ProtocolError(f"{command.name}: body of {len(raw)} bytes exceeds "
                                f"{MAX_BODY_BYTES}")
        return Message(command, raw, list(frames[3:]))
    return Message(command, _body(command, raw), list(frames[3:]))


def _body(command: Command, raw: bytes) -> dict[str, Any]:
    """The JSON object of a body frame, within the size, depth and integer limits."""
    limit = MAX_REGISTER_BODY_BYTES if command is Command.REGISTER else MAX_BODY_BYTES
    if len(raw) > limit:
        raise ProtocolError(f"{command.name}: body of {len(raw)} bytes exceeds {limit}")
    # Every message of the data path comes through here: the checks that cost a Python
    # call per integer or per node run only on bodies that could fail them (a run of 20
    # digits; more brackets than the depth allowed), found by C-speed scans, and then only
    # where the text outside its strings cannot settle them.
    long_digits = _LONG_DIGITS.search(raw) is not None
    brackets = raw.count(b"[") + raw.count(b"{") > MAX_BODY_DEPTH
    text = _without_strings(raw) if long_digits or brackets else None
    try:
        body = json.loads(raw, parse_int=_int) if long_digits and not _long_ints_fit(text) \
            else json.loads(raw)
    except ProtocolError as exc:
        raise ProtocolError(f"{command.name}: {exc}") from None
    except RecursionError:
        raise ProtocolError(f"{command.name}: body nested deeper than {MAX_BODY_DEPTH} "
                            "levels") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"{command.name}: body is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{command.name}: body must be a JSON object")
    if brackets and not _shallow(text) and _depth(body) > MAX_BODY_DEPTH:
        raise ProtocolError(f"{command.name}: body nested deeper than {MAX_BODY_DEPTH} levels")
    return body


_LONG_DIGITS = re.compile(rb"[0-9]{20}")
"""Where an integer could reach 2**64 (19 digits never do)."""


_LONG_INT = re.compile(rb"(?<![0-9eE.+-])-?[0-9]{20,}(?![0-9.eE])")
"""An integer literal of 20 digits or more (not a float's part)."""


def _without_strings(raw: bytes) -> bytes | None:
    """The JSON text ``raw`` without its strings; None when one has an escape (the checks
    on it are then unsure)."""
    return None if b"\\" in raw else _STRING.sub(b"", raw)


def _long_ints_fit(text: bytes | None) -> bool:
    """Whether every integer of 20 digits or more in a body's ``text`` (without its
    strings, :func:`_without_strings`) fits :func:`_int`, found at C speed; False when
    unsure (None): each integer is then parsed by :func:`_int`. (A resumed Loader's state
    holds an entropy of 20 digits and half a million small ints: a Python call per int
    took the broker's loop a second for a 2 MB state.)

    Raises:
        ProtocolError: one does not fit.
    """
    if text is None:
        return False
    for found in _LONG_INT.finditer(text):
        _int(found.group().decode())
    return True


def _int(text: str) -> int:
    """``json.loads``'s integer parser, refusing integers wider than any field."""
    if len(text) > 21:  # 2**64 has 20 digits; a sign is one more
        raise ProtocolError(f"integer of {len(text)} digits in the body")
    value = int(text)
    if not -MAX_BODY_INT < value < MAX_BODY_INT:
        raise ProtocolError(f"integer {value} in the body is out of range")
    return value


_STRING = re.compile(rb'"[^"\\]*"')
"""A JSON string without escapes."""
_INNERMOST = re.compile(rb"[\[{][\]}]")
"""A list or object holding no other (of a body's brackets alone)."""
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _shallow(text: bytes | None) -> bool:
    """Whether a parsed body's ``text`` (without its strings, :func:`_without_strings`)
    nests at most MAX_BODY_DEPTH deep, found at C speed: its brackets, innermost pairs
    taken away at each pass, are gone within that many passes. False when unsure (None):
    :func:`_depth` then walks the parsed body (a resumed Loader's state is tens of
    thousands of small lists; the walk took 50-90 ms of the broker's loop)."""
    if text is None:
        return False
    brackets = text.translate(None, _NOT_BRACKETS)
    for _ in range(MAX_BODY_DEPTH):
        brackets = _INNERMOST.sub(b"", brackets)
        if not brackets:
            return True
    return False


def _depth(value: Any) -> int:
    """How deeply lists and dicts nest in ``value`` (iteratively: no recursion)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_BODY_DEPTH:
                stack.extend((child, depth + 1)
                             for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _bytes(frame: Any) -> bytes:
    if isinstance(frame, bytes):
        return frame
    buffer = getattr(frame, "bytes", None)  # zmq.Frame
    if isinstance(buffer, bytes):
        return buffer
    return bytes(memoryview(frame))


def error_object(exc: BaseException) -> dict[str, str]:
    """An error as the JSON object the protocol carries (the fields of PipelineError)."""
    from zloader.errors import PipelineError

    if not isinstance(exc, PipelineError):
        exc = PipelineError.from_exception(exc, "worker")
    return {"stage": exc.stage, "exc_type": exc.exc_type, "builtin": exc.builtin,
            "message": exc.message, "traceback": exc.traceback, "context": exc.context}


def error_from_object(obj: Any, fallback_stage: str = "worker") -> Exception:
    """Rebuild the PipelineError described by an error object (checked field by field)."""
    from zloader.errors import PipelineError

    if not isinstance(obj, dict):
        return PipelineError.create(fallback_stage, "RuntimeError", f"malformed error {obj!r}")
    text = {k: str(obj.get(k, "")) for k in ("stage", "exc_type", "builtin", "message",
                                              "traceback", "context")}
    return PipelineError.create(text["stage"] or fallback_stage, text["exc_type"],
                                text["message"], text["traceback"], text["context"],
                                builtin=text["builtin"])
