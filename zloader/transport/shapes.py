"""The shapes of this protocol's nested fields, beyond the generic ones of
zloader/transport/fields.py: each a check that returns the value as the record keeps it or
raises :class:`~zloader.transport.fields.Wrong` saying what is wrong (the record's decoder
adds the command and the field). zloader/transport/messages.py declares its records'
fields with them.
"""

from __future__ import annotations

from typing import Any

from zloader._defaults import LOG_MAX_LINE, LOG_MAX_LINES, MAX_MIX_INPUTS, MAX_RANGES, STAGES
from zloader.transport.fields import (
    INDEX,
    MAX_ITEMS,
    MAX_NAME,
    NAME,
    PASS_KEY,
    Wrong,
    boolean,
    integer,
    is_int,
    list_of,
    number,
    obj,
    optional,
    text,
)

MAX_LOG_LINES = LOG_MAX_LINES
MAX_LOG_TEXT = LOG_MAX_LINE + 64
"""``LOG.lines``: at most this many ``[level, text]`` pairs, texts at most this long
(zloader/forward.py cuts lines at LOG_MAX_LINE characters and marks the cut)."""


def error_object(value: Any) -> dict[str, str]:
    """An error object: ``{stage, exc_type, builtin, message, traceback, context}``,
    strings (a missing one reads as empty)."""
    if not isinstance(value, dict) or not all(isinstance(value.get(k, ""), str) for k in
                                              ("stage", "exc_type", "builtin", "message",
                                               "traceback", "context")):
        raise Wrong("must be an error object (stage, exc_type, builtin, message, "
                     "traceback, context: strings)")
    return value


def log_lines(value: Any) -> tuple[tuple[int, str], ...]:
    """``[[level, text], ...]``: at most MAX_LOG_LINES, levels 0-50."""
    if not isinstance(value, list) or len(value) > MAX_LOG_LINES:
        raise Wrong(f"must be a list of at most {MAX_LOG_LINES} [level, text] pairs")
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and is_int(item[0])
                and 0 <= item[0] <= 50 and isinstance(item[1], str)
                and len(item[1]) <= MAX_LOG_TEXT):
            raise Wrong(f"must be [level 0-50, text of at most {MAX_LOG_TEXT} characters] "
                         "pairs")
    return tuple((level, line) for level, line in value)


def doing(value: Any) -> dict[str, Any]:
    """A worker's ``{epoch, split, stage}`` (``HEARTBEAT.doing``)."""
    if not isinstance(value, dict) or value.get("stage") not in STAGES \
            or not (is_int(value.get("epoch")) and value["epoch"] >= 0) \
            or not (value.get("split") is None
                    or (is_int(value["split"]) and value["split"] >= 0)):
        raise Wrong(f"must be {{epoch, split, stage}}, stage one of {', '.join(STAGES)}")
    return value


def job_worker(value: Any) -> dict[str, Any]:
    """An entry of ``JOB.workers``: ``worker``, ``task``, ``endpoint``, ``index`` and,
    when present, ``host_id``, ``host``, ``pid``, ``plain_data``, ``doing`` (a malformed
    ``doing`` reads as absent: the broker passes on what a worker said)."""
    if not (isinstance(value, dict) and all(isinstance(value.get(k), str)
                                            and len(value[k]) <= MAX_NAME
                                            for k in ("worker", "task", "endpoint"))
            and is_int(value.get("index")) and value["index"] >= 0
            and isinstance(value.get("host_id", ""), str)
            and isinstance(value.get("host", ""), str)
            and is_int(value.get("pid", 0))
            and isinstance(value.get("plain_data", False), bool)):
        raise Wrong("entries must be {worker, task, endpoint, index, host_id, host, pid, "
                     "plain_data}")
    if "doing" in value:
        try:
            doing(value["doing"])
        except Wrong:
            value = {k: v for k, v in value.items() if k != "doing"}
    return value


def fence(value: Any) -> dict[str, Any]:
    """An entry of ``JOB.fences``: ``{id, worker, task, splits: [[pass key, split], ...],
    waiting: [consumer ids]}``, and a shared job's ``taker``: the worker that makes the
    dead one's splits again (its ``END`` names the fence)."""
    if not (isinstance(value, dict) and all(isinstance(value.get(k), str)
                                            for k in ("id", "worker", "task"))
            and isinstance(value.get("splits"), list)
            and all(isinstance(s, list) and len(s) == 2 and is_int(s[1]) and s[1] >= 0
                    for s in value["splits"])
            and isinstance(value.get("waiting", []), list)
            and isinstance(value.get("taker", ""), str)):
        raise Wrong("entries must be {id, worker, task, splits: [[pass, split], ...], "
                     "waiting}")
    try:
        for key, _ in value["splits"]:
            PASS_KEY(key)
    except Wrong:
        raise Wrong("entries' splits must be [pass key, split]") from None
    return value


def drained_entry(value: Any) -> dict[str, Any]:
    """An entry of ``JOB.drained``: ``{task}``, a task that left its job cleanly; a shared
    job's that handed splits on adds ``taker`` (the worker that makes them again, naming
    the task in its ENDs) and ``epochs`` (those it handed splits of)."""
    if not (isinstance(value, dict) and isinstance(value.get("task"), str)
            and isinstance(value.get("taker", ""), str)
            and isinstance(value.get("epochs", []), list)
            and all(is_int(e) and e >= 0 for e in value.get("epochs", []))):
        raise Wrong("entries must be {task, taker, epochs: [epoch, ...]}")
    return value


ROUNDS = list_of(INDEX)


def pipeline_ref(value: Any) -> dict[str, Any]:
    """Where a pipeline is: ``{inherited: true}`` (forked workers hold it) or ``{endpoint,
    sha256, bytes}`` (fetched from its Loader)."""
    if value == {"inherited": True}:
        return value
    if not (isinstance(value, dict) and isinstance(value.get("endpoint"), str)
            and len(value["endpoint"]) <= MAX_NAME and isinstance(value.get("sha256"), str)
            and len(value["sha256"]) <= MAX_NAME and is_int(value.get("bytes"))
            and value["bytes"] >= 0):
        raise Wrong("must be {inherited: true} or {endpoint, sha256, bytes}")
    return value


def source_ref(value: Any) -> dict[str, str]:
    """Where an in-memory source's data is: ``{endpoint, kind}``, kind arrays or items."""
    if not (isinstance(value, dict) and isinstance(value.get("endpoint"), str)
            and len(value["endpoint"]) <= MAX_NAME
            and value.get("kind") in ("arrays", "items")):
        raise Wrong("must be {endpoint, kind: 'arrays' or 'items'}")
    return value


PIPELINE_REF = optional(pipeline_ref)


def endpoint(value: Any) -> str:
    """A peer's address: ``tcp://HOST:PORT`` or ``ipc://PATH``."""
    if not (isinstance(value, str) and len(value) <= MAX_NAME
            and value.startswith(("tcp://", "ipc://"))):
        raise Wrong(f"must be tcp://HOST:PORT or ipc://PATH, at most {MAX_NAME} characters")
    return value


HOLDS = list_of(text(128), 0, 64)
"""``READY.holds``: at most 64 fingerprints."""


MIX_WEIGHTS = list_of(number(0.0, 1.0), 1, MAX_MIX_INPUTS)
"""A mix's weights, each from 0 to 1 (``OPEN.weights``, ``WEIGHTS.weights``)."""

MIX_PART = integer(0, MAX_MIX_INPUTS - 1)
"""A stream's number (``DATA.part``, ``END.part``, ``CREDIT.part``): a mix input the
consumer draws, a deterministic job's shard, or both (zloader/plan.py ``Plan.parts``)."""


def mix_inputs(value: Any) -> bool:
    """``[[num_splits >= 0, shuffle_splits, seed or null], ...]``: a mix's inputs."""
    return (isinstance(value, list) and 0 < len(value) <= MAX_MIX_INPUTS
            and all(isinstance(item, list) and len(item) == 3 and is_int(item[0])
                    and item[0] >= 0 and isinstance(item[1], bool)
                    and (item[2] is None or is_int(item[2])) for item in value))


def source_info(value: Any) -> dict[str, Any]:
    """``REGISTER.source``: ``{num_splits >= 0, seed: integer or null, shuffle_splits}``
    and, for a mix, ``inputs``: each input's ``[num_splits, shuffle_splits, seed]``,
    whose splits add up to ``num_splits``."""
    if not (isinstance(value, dict) and is_int(value.get("num_splits"))
            and value["num_splits"] >= 0
            and (value.get("seed") is None or is_int(value["seed"]))
            and isinstance(value.get("shuffle_splits", False), bool)):
        raise Wrong("must be {num_splits >= 0, seed: an integer or null, shuffle_splits}")
    inputs = value.get("inputs")
    if inputs is not None and not (mix_inputs(inputs) and sum(
            item[0] for item in inputs) == value["num_splits"]):
        raise Wrong(f"inputs must be 1 to {MAX_MIX_INPUTS} [num_splits, shuffle_splits, "
                    "seed] whose splits add up to num_splits")
    return obj(value)


def stuck_report(value: Any) -> dict[str, Any]:
    """An entry of ``HEARTBEAT.stuck``: ``{worker, task, seconds}``."""
    if not (isinstance(value, dict) and isinstance(value.get("worker"), str)
            and isinstance(value.get("task"), str)
            and isinstance(value.get("seconds"), (int, float))
            and not isinstance(value["seconds"], bool)):
        raise Wrong("must be {worker, task, seconds}")
    return value


def split_info(value: Any) -> tuple[tuple[int, ...], int, dict[str, Any]]:
    """``[pass key, split, info]`` (``DELIVERED.splits``, ``HEARTBEAT.reread``); what
    ``info`` holds is read by zloader/lineage/."""
    if not (isinstance(value, list) and len(value) == 3 and is_int(value[1])
            and value[1] >= 0 and isinstance(value[2], dict)):
        raise Wrong("must be [pass, split, info]")
    try:
        return PASS_KEY(value[0]), value[1], obj(value[2])
    except Wrong:
        raise Wrong("must be [pass, split, info], pass a list of integers >= 0") from None


def places(value: Any) -> list[list[int]]:
    """``[[start, end], ...]``: ascending ranges of places, each ``0 <= start < end``, at
    most MAX_RANGES (what a trainer had of what a worker made, zloader/sharing/handover.py)."""
    if not isinstance(value, list) or len(value) > MAX_RANGES:
        raise Wrong(f"must be a list of at most {MAX_RANGES} [start, end] ranges")
    last = 0
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and is_int(item[0])
                and is_int(item[1]) and last <= item[0] < item[1] < 1 << 62):
            raise Wrong("must hold ascending [start, end] ranges, 0 <= start < end")
        last = item[1]
    return value


def had_counts(value: Any) -> dict[str, Any]:
    """``{consumer id: elements}`` (a handover entry's ``had``: a count of the first, or
    the places of those it had, :func:`places`)."""
    if not isinstance(value, dict) or len(value) > MAX_ITEMS or not all(
            isinstance(k, str) and 0 < len(k) <= MAX_NAME for k in value):
        raise Wrong("must map consumer ids to counts >= 0 or [start, end] ranges")
    for v in value.values():
        if not (is_int(v) and v >= 0):
            places(v)
    return value


def weight_switch(value: Any) -> list[Any]:
    """``[pass, draws, weights]``: a shared job's mix drew pass ``pass`` with ``weights``
    from its draw number ``draws`` on (zloader/mixing.py ``Switches``)."""
    if not (isinstance(value, list) and len(value) == 3 and is_int(value[1])
            and value[1] >= 0):
        raise Wrong("must be [pass, draws, weights]")
    return [list(PASS_KEY(value[0])), value[1], list(MIX_WEIGHTS(value[2]))]


_SEGMENT_FIELDS = {"n": INDEX, "epoch": INDEX, "index": INDEX, "pass": PASS_KEY,
                   "splits": list_of(INDEX), "served": list_of(NAME), "had": had_counts,
                   "switches": list_of(weight_switch), "last": boolean}


def handover_entry(value: Any) -> dict[str, Any]:
    """An entry of ``HEARTBEAT.handover`` and ``HANDOVER.segments``: ``{n, epoch, index,
    pass, splits, served, had, switches, last}`` (zloader/sharing/handover.py)."""
    if not isinstance(value, dict) or set(value) != set(_SEGMENT_FIELDS):
        raise Wrong(f"must be {{{', '.join(_SEGMENT_FIELDS)}}}")
    try:
        checked = {name: check(value[name]) for name, check in _SEGMENT_FIELDS.items()}
    except Wrong as exc:
        raise Wrong(f"must be {{{', '.join(_SEGMENT_FIELDS)}}}: {exc}") from None
    return {name: list(v) if isinstance(v, tuple) else v  # (passed on as they came)
            for name, v in checked.items()}


def shared_answer(value: Any) -> dict[str, Any]:
    """``DELIVERED.shared``: ``{epoch, done, count}``, and optionally ``ranges`` (the
    places of the elements it got, :func:`places`)."""
    if not (isinstance(value, dict) and set(value) - {"ranges"} == {"epoch", "done", "count"}
            and is_int(value["epoch"]) and value["epoch"] >= 0
            and isinstance(value["done"], bool)
            and is_int(value["count"]) and value["count"] >= 0):
        raise Wrong("must be {epoch, done, count[, ranges]}")
    if "ranges" in value:
        places(value["ranges"])
    return value


