"""Where each element came from: the bookkeeping behind exactly-once epochs.

With dynamic sharding (no sharing, coordination or balancing) a worker tags every source
element with its *origin*: (pass, split, index), the index counting the elements the
source yields for that split. Stages carry the tags (docs/reliability.md):

- a map keeps its input's tag; a shuffle moves tags with their elements;
- a batch holds the tags of its rows; an unbatch gives each row its own back;
- an element dropped on the way (a filter, ``on_error="skip"``, a dropped remainder) is
  still *accounted for*: its tag rides with the next record as a loose origin.

The consumer keeps a :class:`Ledger` of what it received and of what it yielded. When a
worker dies, the broker asks the consumers which elements of its splits they hold and hands
the splits out again with those indices to skip; ``Loader.state_dict()`` is the yielded
ledger. Re-reading a split this way needs the source to yield the same elements for it each
time: a worker re-reading a split checks the count and a digest of what it read against the
first reading and reports a difference as a :class:`~zloader.errors.PipelineError`.
"""

from __future__ import annotations

import base64
import itertools
import operator
import struct
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from zloader._defaults import (
    GROUP_KEY,
    LEDGER_FOLD_RECORDS,
    LEDGER_FOLD_RUNS,
    LIGHT_BYTES,
    LIGHT_ITEMS,
    MAX_GROUP_MEMBERS,
    MERGE_COUNT_RUNS,
    MERGE_PLACES,
    MERGE_SPAN_FACTOR,
    MERGE_SPAN_SLACK,
    READ_AHEAD_SECONDS,
    SCATTER_SAMPLE,
    SMALL_ORIGIN_BLOCK,
)
from zloader.errors import PipelineError

__all__ = ["Assigned", "Group", "Ledger", "Origin", "Origins", "Ranges", "Tagged", "code",
           "decode_origins", "digest", "encode_origins", "exactly_once", "gather", "light",
           "merge_info", "pack", "read_split", "read_split_chunks", "runs_of_list", "split_tags",
           "take",
           "unpack", "untag"]

Key = tuple[int, ...]
DIGEST_BYTES = 4096
"""Bytes of each buffer of a source element that the reproducibility digest covers."""


def exactly_once(requested: bool, sharding: str, shared: bool, deterministic: bool,
                 coordinated: bool, balanced: int) -> bool:
    """Whether a job runs exactly-once (its elements carry their origins, and a worker that
    leaves loses and repeats nothing, docs/reliability.md).

    Args:
        requested: the Loader asked for it (``REGISTER.options.exactly_once``).
        sharding: the job's sharding mode; only ``"dynamic"`` can re-hand splits.
        shared: the job is shared by trainers (``share``).
        deterministic: its elements come in a fixed order.
        coordinated: its consumers read round by round (``num_consumers``).
        balanced: ``balanced`` batches per consumer (0: not balanced).

    Returns:
        True when requested and the job is dynamic, neither shared, balanced, coordinated
        nor deterministic. The one rule: the broker applies it to REGISTER
        (zloader/broker/jobs.py) and the Loader to its own arguments.
    """
    return (requested and sharding == "dynamic" and not shared and not deterministic
            and not coordinated and not balanced)



Origin = tuple[int, ...] | np.ndarray
"""The codes (see :func:`code`) of the source elements an element holds: a 1-tuple for a
source element (made once per element, it must be cheap), an int64 array for a batch
(its rows' codes, gathered at numpy speed: :func:`gather`)."""

Tagged = tuple[Any, Origin]
"""An element on its way through the worker part: ``(value, origin)``."""
_VALUE, _ORIGIN = operator.itemgetter(0), operator.itemgetter(1)

INDEX_BITS = 32
"""A code is ``read << INDEX_BITS | index``: the producer's ``read``-th split reading
(``Context.reads`` names its pass id and split) and the element's index in the split."""
INDEX_MASK = (1 << INDEX_BITS) - 1
MAX_PASS_ID = 1 << 20
MAX_READ = (1 << 31) - 1
MAX_KEY_LENGTH = 64


def code(read: int, index: int) -> int:
    """The origin code of element ``index`` of the producer's ``read``-th split reading."""
    return read << INDEX_BITS | index


@dataclass(frozen=True)
class Group:
    """The source elements of one batch that the map after it turned into another number
    of rows (``batch(k).map(f).unbatch()`` with ``f`` returning any number of rows: a
    packer, a tokenizer that chunks), kept so that rows lost with their worker, or not
    yet yielded when a state was taken, can be made again from them (docs/reliability.md,
    "Stages that change the number of elements").

    Attributes:
        key, split, index: where the first of the elements (the anchor) came from.
        position: the unbatch's position in its pipeline (a mix input's, for a mix).
        rows: how many rows the map made of them.
        members: the elements, in the batch's order, as (pass key, split, first index,
            length) runs; a run in the pass of another group's rows (:attr:`rows_key`)
            names rows of that group (a packer after a batched tokenizer).
        inner: the groups whose rows it holds, and theirs, to make it again (not part
            of what names it).
    """

    key: Key
    split: int
    index: int
    position: int
    rows: int
    members: tuple[tuple[Key, int, int, int], ...]
    inner: tuple[Group, ...] = field(default=(), compare=False)

    @property
    def id(self) -> tuple[Key, int, int, int]:
        """What names the group: its anchor and its unbatch."""
        return (self.key, self.split, self.position, self.index)

    @property
    def rows_key(self) -> Key:
        """The pass its rows' origins name (row ``j`` is index ``j`` of split ``split``)."""
        return (*self.key, GROUP_KEY + self.position, self.index)

    def to_json(self, have: Iterable[int] = (), inner: Sequence[Group] = ()) -> list[Any]:
        """``[key, split, index, position, rows, members, have]`` (``have``: the rows
        held, packed), and the ``inner`` groups as an eighth item when there are any."""
        value = [list(self.key), self.split, self.index, self.position, self.rows,
                 [[list(k), s, a, n] for k, s, a, n in self.members], pack(have)]
        if inner:
            value.append([group.to_json() for group in inner])
        return value

    @classmethod
    def from_json(cls, value: Any) -> tuple[Group | None, tuple[Key, int, int, int], set[int]]:
        """A group, its id and the rows held, from :meth:`to_json`'s value; the group is
        None when only its rows are known (``rows`` -1, no members: a consumer of a
        ``job_name`` that got rows of it and not its elements).

        Raises:
            ValueError: ``value`` is not such a value.
        """
        if not (isinstance(value, list) and len(value) in (7, 8) and _is_key(value[0])
                and all(_natural(v) for v in value[1:4]) and isinstance(value[4], int)
                and isinstance(value[5], list) and len(value[5]) <= MAX_GROUP_MEMBERS):
            raise ValueError(f"a group must be [key, split, index, position, rows, members, "
                             f"have(, inner groups)], got {value!r:.80}")
        key, split, index, position, rows, runs, have = value[:7]
        inner: list[Group] = []
        if len(value) == 8:  # (the groups it holds rows of, and theirs: one level)
            if not isinstance(value[7], list) or len(value[7]) > MAX_GROUP_MEMBERS:
                raise ValueError("a group's inner groups must be a list")
            for one in value[7]:
                if isinstance(one, list) and len(one) == 8:
                    raise ValueError("a group's inner groups hold no inner groups")
                group, _, _ = cls.from_json(one)
                if group is None:
                    raise ValueError("a group's inner group needs its elements and rows")
                inner.append(group)
        gid = (tuple(key), split, position, index)
        if split > INDEX_MASK or index > INDEX_MASK:
            raise ValueError(f"a group's split and index must be < 2**32, got {value!r:.80}")
        held = unpack(have, MAX_GROUP_MEMBERS)
        if rows == -1 and not runs:
            return None, gid, held
        members = []
        for run in runs:
            if not (isinstance(run, list) and len(run) == 4 and _is_key(run[0])
                    and all(_natural(v) for v in run[1:]) and run[3] >= 1
                    and run[1] <= INDEX_MASK and run[2] + run[3] <= INDEX_MASK + 1):
                raise ValueError(f"a group's member run must be [key, split, first, length], "
                                 f"got {run!r:.80}")
            members.append((tuple(run[0]), run[1], run[2], run[3]))
        if not 1 <= rows <= MAX_GROUP_MEMBERS * 64 or not members \
                or sum(run[3] for run in members) > MAX_GROUP_MEMBERS \
                or (members[0][0], members[0][1], members[0][2]) != (gid[0], split, index):
            raise ValueError(f"a group must have rows >= 1 and start with its anchor, got "
                             f"{value!r:.80}")
        if held and max(held) >= rows:
            raise ValueError(f"a group's rows held must be below its {rows} rows")
        return cls(gid[0], split, index, position, rows, tuple(members), tuple(inner)), gid, held


def group_of_rows(key: Key, split: int) -> tuple[Key, int, int, int] | None:
    """The id of the group whose rows' origins name pass ``key`` and ``split``
    (:attr:`Group.rows_key`), or None when ``key`` is a pass of source elements."""
    if len(key) > 2 and key[-2] >= GROUP_KEY:
        return (key[:-2], split, key[-2] - GROUP_KEY, key[-1])
    return None


def anchor_split(key: Key, split: int) -> tuple[Key, int]:
    """The split of source elements that a group anchored at ``split`` of pass ``key``
    stands on: the split itself, or for a group whose first element is a row of another
    group (its pass is that group's :attr:`Group.rows_key`), that group's, and so on. A
    group is made again with that split, and the split stays open until the group's rows
    are all held."""
    while len(key) > 2 and key[-2] >= GROUP_KEY:
        key = key[:-2]  # (a rows key is its group's anchor key, the unbatch and the index)
    return key, split


@dataclass(frozen=True)
class Assigned:
    """A split handed to a worker: ``pass_key`` names the pass it belongs to (a re-queued
    split may be read in a later pass), ``skip`` the indices already delivered, ``expect``
    the (count, digest) of an earlier reading when one is known, ``groups`` the groups
    anchored in it whose rows are to be made again (with the rows not to make)."""

    split: int
    pass_key: Key
    skip: frozenset[int] = frozenset()
    expect: tuple[int, int] | None = None
    groups: tuple[tuple[Group, frozenset[int]], ...] = ()


def read_split(source: Any, assigned: Assigned, pass_id: int, ctx: Any) -> Iterator[Tagged]:
    """Tagged elements of one split: :func:`read_split_chunks`, one ``(element, (code,))``
    at a time (tagged at C speed, ``zip``). Only ints are read ahead: any other element
    is read as the stage after the source asks for it, as a source without exactly-once
    is (a torch dataset's batch, with its random draws, is made in its turn)."""
    for values, codes in read_split_chunks(source, assigned, pass_id, ctx, ahead=False):
        yield from zip(values, zip(codes.tolist()), strict=True)


def read_split_chunks(source: Any, assigned: Assigned, pass_id: int, ctx: Any,
                      size: int = 0, ahead: bool = True
                      ) -> Iterator[tuple[list[Any], np.ndarray]]:
    """The elements of one split, less ``assigned.skip``, in consecutive chunks of
    ``(values, codes)`` (one origin code each, an int64 array); notes the reading in
    ``ctx.tally.reads`` and records (count, digest) in ``ctx.tally.ends`` once the split is read.

    Chunks hold ``size`` elements (the last fewer); with ``size`` 0 a chunk grows from one
    element to DIGEST_GROUP while the source gives :func:`light` elements, a chunk in under
    READ_AHEAD_SECONDS (a slow source, or one of heavy elements, is read one element at a
    time: its first elements must not wait for the chunk's last, nor its arrays be made
    ahead of their turn; with ``ahead`` False, only ints are read ahead). Every element of
    a chunk is in the digest before the chunk is yielded (a later stage may change it in
    place). A source that fails mid-read has the elements it gave before the failure
    yielded first.

    Raises:
        PipelineError: the split read differently from its earlier reading.
    """
    split, skip = assigned.split, assigned.skip
    base = code(len(ctx.tally.reads), 0)
    ctx.tally.reads.append((pass_id, split))
    # An earlier reading's digest taken the first way (no DIGEST_MARK): take it so again.
    legacy = assigned.expect is not None and not int(assigned.expect[1]) & DIGEST_MARK
    running = _Digest(legacy)
    elements = iter(source.read(split, ctx))
    ints = type(elements) is _RANGE_ITERATOR  # (plain ints, not checked one by one)
    fixed = size > 0
    count, size = 0, size if fixed else 1
    while True:
        started = time.perf_counter()
        chunk, failure = take(elements, size)  # (a failure: yielded after the elements)
        if not chunk:
            if failure is not None:
                raise failure
            break
        group = running.add(chunk, ints)
        if not fixed:
            quick = time.perf_counter() - started <= READ_AHEAD_SECONDS
            # Ints: as many as complete the digest's group; other light ones: twice as
            # many; heavy ones one at a time, as they are made.
            size = ((group or min(2 * size, DIGEST_GROUP))
                    if quick and (group or (ahead and light(chunk))) else 1)
        first, count = count, count + len(chunk)
        codes = np.arange(base + first, base + count, dtype=np.int64)
        if skip:
            kept = [at for at in range(len(chunk)) if first + at not in skip]
            if len(kept) < len(chunk):
                chunk, codes = [chunk[at] for at in kept], codes[kept]
        if chunk:
            yield chunk, codes
        del chunk
        if failure is not None:
            raise failure
    crc = running.value()
    if assigned.expect is not None and tuple(assigned.expect) != (count, crc):
        raise PipelineError.create(
            "source", "RuntimeError",
            f"split {split} read differently the second time ({count} elements, digest "
            f"{crc:#x}; first {assigned.expect[0]}, {assigned.expect[1]:#x}): exactly-once "
            "needs each split of an epoch to yield the same elements every time it is read "
            "(seed randomness per split and epoch; no reading of data that changes); pass "
            "exactly_once=False to accept repeats instead", context=f"split {split}",
            builtin="RuntimeError")
    ctx.tally.ends.append([pass_id, split, count, crc])


def take(elements: Iterator[Any], size: int) -> tuple[list[Any], BaseException | None]:
    """Up to ``size`` next ``elements``, and what the iterator raised after them (None if
    nothing): the elements a failing source or stage gave before it failed are kept."""
    taken: list[Any] = []
    try:
        taken.extend(itertools.islice(elements, size))
    except BaseException as exc:
        return taken, exc
    return taken, None


def light(elements: list[Any]) -> bool:
    """Whether the first and the last of ``elements`` are light enough to read ahead:
    numbers, None, strings, bytes and numpy arrays of at most LIGHT_BYTES (a path, a token,
    a line, a row of a table), or a tuple, list or dict of at most LIGHT_ITEMS such (a path
    and a label; a row of named columns). Heavier ones (images, tensors, batches) are read
    as they are used, so that a producer's fresh memory stays warm and bounded."""
    for element in (elements[0], elements[-1]) if elements else ():
        kind = type(element)
        if kind is tuple or kind is list or kind is dict:
            items = element.values() if kind is dict else element
            if len(element) > LIGHT_ITEMS or not all(map(_light, items)):
                return False
        elif not _light(element):
            return False
    return True


def _light(value: Any) -> bool:
    kind = type(value)
    if kind is str or kind is bytes:
        return len(value) <= LIGHT_BYTES
    if kind is np.ndarray:
        return bool(value.nbytes <= LIGHT_BYTES)
    return kind in _ATOMS or isinstance(value, np.generic)


_ATOMS = frozenset((int, float, bool, type(None)))

DIGEST_GROUP = 256
"""A split's digest hashes consecutive plain ints (and bools) this many at a time; the
reader of a split reads at most this many ahead. Part of the digest: changing it changes
every split's digest, and a resumed state's (a split read again would be refused)."""
DIGEST_MARK = 1 << 32
"""Set in a digest taken by groups (:class:`_Digest`); an earlier one, taken an element at
a time, has it clear (a state saved by an older version: its splits are read again so)."""
_GROUPED = frozenset((int, bool))
_RANGE_ITERATOR = type(iter(range(0)))


class _Digest:
    """The running digest of a split's elements. Plain ints and bools, whose hash is the
    same in every process, are hashed a group at a time (``hash`` of a tuple of up to
    DIGEST_GROUP consecutive ones, a run of them cut from its start); any other element
    mixes in :func:`digest`. ``legacy``: every element by :func:`digest`, as a digest
    without DIGEST_MARK was taken."""

    __slots__ = ("crc", "legacy", "pending")

    def __init__(self, legacy: bool = False) -> None:
        self.crc = 0
        self.legacy = legacy
        self.pending: list[Any] = []  # ints of the current run not hashed yet

    def add(self, elements: list[Any], ints: bool = False) -> int:
        """Mix ``elements`` in (``ints``: known to be plain ints); returns how many ints
        complete the current group when ``elements`` are all plain ints (or bools), else 0."""
        grouped = ints or set(map(type, elements)) <= _GROUPED
        if self.legacy:
            for element in elements:
                self.crc = digest(element, self.crc)
            return DIGEST_GROUP if grouped else 0
        pending = self.pending
        if grouped:
            if not pending and len(elements) == DIGEST_GROUP:  # (the usual read)
                self._fold(elements)
                return DIGEST_GROUP
            pending.extend(elements)
            while len(pending) >= DIGEST_GROUP:
                self._fold(pending[:DIGEST_GROUP])
                del pending[:DIGEST_GROUP]
            return DIGEST_GROUP - len(pending)
        for element in elements:
            if type(element) in _GROUPED:
                pending.append(element)
                if len(pending) == DIGEST_GROUP:
                    self._fold(pending)
                    pending.clear()
                continue
            if pending:
                self._fold(pending)
                pending.clear()
            self.crc = digest(element, self.crc)
        return 0

    def _fold(self, group: list[Any]) -> None:
        self.crc = (self.crc * 1_000_003 ^ hash(tuple(group))) & 0xFFFFFFFF

    def value(self) -> int:
        """The digest of everything added."""
        if self.legacy:
            return self.crc
        if self.pending:
            self._fold(self.pending)
            self.pending.clear()
        return self.crc | DIGEST_MARK


def digest(element: Any, crc: int, depth: int = 0) -> int:
    """A cheap running checksum of a source element (types, lengths, leading bytes), the
    same in every process (numbers mix in their hash, which Python does not randomize)."""
    kind = type(element)
    if kind is int or kind is float or kind is bool:
        return (crc * 1_000_003 ^ hash(element)) & 0xFFFFFFFF
    if element is None:
        return (crc * 1_000_003 ^ 0x5EED) & 0xFFFFFFFF
    if isinstance(element, np.ndarray):
        crc = zlib.crc32(f"{element.dtype}{element.shape}".encode(), crc)
        flat = element.reshape(-1)
        return zlib.crc32(np.ascontiguousarray(flat[:DIGEST_BYTES // max(1, flat.itemsize)])
                          .tobytes(), crc)
    if isinstance(element, (bytes, bytearray, memoryview)):
        data = bytes(element[:DIGEST_BYTES])
        return zlib.crc32(data, zlib.crc32(len(element).to_bytes(8, "little"), crc))
    if isinstance(element, str):
        return zlib.crc32(element[:DIGEST_BYTES].encode("utf-8", "replace"), crc)
    if isinstance(element, (int, float, complex, np.generic)):
        return zlib.crc32(repr(element).encode(), crc)
    if depth < 4 and isinstance(element, (tuple, list)):
        for item in element[:16]:
            crc = digest(item, crc, depth + 1)
        return zlib.crc32(len(element).to_bytes(8, "little"), crc)
    if depth < 4 and isinstance(element, dict):
        for name, item in list(element.items())[:16]:
            crc = digest(item, digest(name, crc, depth + 1), depth + 1)
        return crc
    return zlib.crc32(type(element).__name__.encode(), crc)


# --- origins on the wire: one block after a record's codec buffers -------------------------
#
# The block is little-endian int64s: a head of eight (elements, the count of origins every
# element has or -1, loose origins, pass keys, split ends, runs, reads, group ints), then
# the per-element counts when they differ, the pass keys (pass id, length, key...), the
# split ends (pass id, split, count, digest) and the groups formed (:class:`Group`: anchor
# pass id, split, index, position, rows, run count, then its member runs: pass id, split,
# first index, length); then the origins in one of two forms. Runs (pass
# id, split, first index, length), when they are few (consecutive elements of a split, as
# most records in order hold, are one run); or, for scattered origins (a shuffle's), the
# table of the split readings they come from (read, pass id, split) and the codes
# themselves, which the consumer sorts into ranges many records at a time. Either way the
# origins in order are the loose ones, then each element's.

_HEAD = 8


def gather(origins: Sequence[Origin | int]) -> np.ndarray:
    """The codes of ``origins`` (each a code, a tuple of codes or an int64 array) in
    order, as one new int64 array: a batch's rows' origins, taken at numpy speed."""
    if isinstance(origins, np.ndarray):  # (codes, as a chunk of source elements has)
        return np.array(origins, np.int64)
    if origins and type(origins[0]) is int:
        return np.fromiter(origins, np.int64, len(origins))
    if origins and all(type(origin) is np.ndarray for origin in origins):  # (batches')
        return np.concatenate(origins)
    try:  # (one origin each, as a tagged source element has)
        return np.fromiter([c for (c,) in origins], np.int64,  # type: ignore[misc]
                           len(origins))
    except (TypeError, ValueError):
        pass
    if not origins:
        return np.empty(0, np.int64)
    return np.concatenate([np.asarray(origin, np.int64).reshape(-1) for origin in origins])


def split_tags(elements: list[Tagged]) -> tuple[list[Any], np.ndarray | list[Origin]]:
    """The values of tagged ``elements`` and their origins, in order: an int64 array of
    their codes when each holds one (a source element's), else the list of origins."""
    values = list(map(_VALUE, elements))
    try:  # (one code each: unpacked straight from the elements)
        return values, np.fromiter([c for _, (c,) in elements], np.int64, len(elements))
    except (TypeError, ValueError):
        return values, list(map(_ORIGIN, elements))


def untag(elements: list[Tagged]) -> tuple[list[Any], np.ndarray]:
    """The values of tagged ``elements`` and their origins' codes, in order."""
    values, origins = split_tags(elements)
    return values, origins if isinstance(origins, np.ndarray) else gather(origins)


def encode_origins(origins: Sequence[Origin], loose: list[int],
                   reads: list[tuple[int, int]], pass_keys: dict[Key, int],
                   ends: list[list[int]], groups: Sequence[list[int]] = (),
                   keys: Sequence[Key] | None = None) -> bytes:
    """The origin block of a record whose elements hold ``origins`` (their codes: tuples,
    or int64 arrays), with ``loose`` codes before them, the split ``ends`` ([pass id,
    split, count, digest]) read since the last record and the ``groups`` formed since
    ([anchor pass id, split, index, position, rows, runs, (pass id, split, first, length)
    per run], zloader/groups.py); ``reads`` and ``pass_keys`` are the producer's tables,
    ``keys`` the pass keys by id when it keeps them (a block then names its passes in time
    of the passes it uses, not of all the run's: one a group)."""
    counts = list(map(len, origins))
    uniform = counts[0] if counts and counts.count(counts[0]) == len(counts) else -1
    total = len(loose) + sum(counts)
    # An element's origins form a set: sorted, a batch's rows of one split make runs.
    ordered = total > 1 and (uniform != 1 or bool(loose))
    table: list[tuple[int, int, int]] = []  # (read, pass id, split): with the codes
    scattered = b""  # the codes, when they go as they are
    if total <= SMALL_ORIGIN_BLOCK:  # (most records of large elements: no numpy call is cheaper)
        lists = [o.tolist() if isinstance(o, np.ndarray) else o for o in origins]
        if ordered:
            flat = sorted(loose) + [c for origin in lists for c in sorted(origin)]
        else:
            flat = [*loose, *itertools.chain.from_iterable(lists)]
        runs: Any = runs_of_list(flat, reads)
    else:
        first = len(loose)
        # (one batch's codes, as most records of a shuffle hold: read, not changed here)
        one = not loose and len(origins) == 1 and type(origins[0]) is np.ndarray
        codes = (cast(np.ndarray, origins[0]) if one
                 else gather([tuple(loose), *origins] if loose else origins))
        if _scattered(codes):  # (a shuffle's)
            table = _reads_of(codes, reads)
            runs = []
            scattered = codes.tobytes()
        else:
            if ordered:
                codes = _sorted_rows(codes.copy() if one else codes, first, counts, uniform)
            runs = _runs_of_array(codes, reads)
    used = {*(_distinct(runs[:, 0]) if isinstance(runs, np.ndarray) else (r[0] for r in runs)),
            *(end[0] for end in ends), *(entry[1] for entry in table),
            *(pass_id for group in groups for pass_id in (group[0], *group[6::4]))}
    entries = ([(pass_id, keys[pass_id]) for pass_id in sorted(used)] if keys is not None
               else [(pass_id, key) for key, pass_id in pass_keys.items() if pass_id in used])
    grouped = list(itertools.chain.from_iterable(groups))
    head = [len(counts), uniform, len(loose), len(entries), len(ends), len(runs), len(table),
            len(grouped)]
    front = [*head, *(counts if uniform == -1 else ()),
             *(v for pass_id, key in entries for v in (pass_id, len(key), *key)),
             *itertools.chain.from_iterable(ends), *grouped,
             *itertools.chain.from_iterable(table)]
    if table:
        return struct.pack(f"<{len(front)}q", *front) + scattered
    if isinstance(runs, np.ndarray):
        return np.array(front, np.int64).tobytes() + runs.tobytes()
    front.extend(itertools.chain.from_iterable(runs))
    return struct.pack(f"<{len(front)}q", *front)


def _sorted_rows(codes: np.ndarray, first: int, counts: list[int], uniform: int) -> np.ndarray:
    """``codes`` with the ``first`` (loose) ones sorted, and each element's (``counts``,
    all ``uniform`` when it is not -1) sorted among themselves."""
    codes[:first].sort()
    if uniform > 0:  # (every element as many: one sort of the rows)
        codes[first:].reshape(-1, uniform).sort(axis=1)
    elif len(counts) == 1:
        codes[first:].sort()
    else:
        segments = np.repeat(np.arange(len(counts) + 1), [first, *counts])
        codes = codes[np.lexsort((codes, segments))]
    return codes


def _scattered(codes: np.ndarray) -> bool:
    """Whether ``codes`` make runs of fewer than four on average (judged by their first
    SCATTER_SAMPLE): then they travel as codes, not runs."""
    sample = codes[:SCATTER_SAMPLE].tolist()
    steps = map(operator.sub, sample[1:], sample)
    return 4 * (len(sample) - 1 - list(steps).count(1)) >= len(sample)


def _reads_of(codes: np.ndarray, reads: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The (read, pass id, split) of every split reading ``codes`` come from, and of those
    from the oldest of them to the producer's latest when they are few (one numpy call,
    not a sort)."""
    low, high = int(np.minimum.reduce(codes)) >> INDEX_BITS, len(reads) - 1
    used = (range(low, high + 1) if high - low < max(64, len(codes) // 16)
            else np.unique(codes >> INDEX_BITS).tolist())
    return [(read, *reads[read]) for read in used]


def _distinct(values: np.ndarray) -> list[int]:
    """The distinct values of a non-empty int64 array (mostly one)."""
    low, high = int(values.min()), int(values.max())
    return [low] if low == high else np.unique(values).tolist()


def runs_of_list(flat: list[int], reads: list[tuple[int, int]]) -> list[list[int]]:
    """(pass id, split, first index, length) runs of the codes ``flat``, in order."""
    runs: list[list[int]] = []
    last = -2
    for origin in flat:
        if origin == last + 1:
            runs[-1][3] += 1
        else:
            runs.append([*reads[origin >> INDEX_BITS], origin & INDEX_MASK, 1])
        last = origin
    return runs


def _runs_of_array(codes: np.ndarray, reads: list[tuple[int, int]]) -> np.ndarray:
    """:func:`_runs_of_list` at numpy speed, for many codes: an int64 (n, 4) array."""
    firsts = np.flatnonzero(np.diff(codes) != 1) + 1
    runs = np.empty((len(firsts) + 1, 4), np.int64)
    starts = codes[np.concatenate(([0], firsts))]
    runs[:, 2] = starts & INDEX_MASK
    runs[:, 3] = np.diff(firsts, prepend=0, append=len(codes))
    read_ids = starts >> INDEX_BITS
    low, high = int(read_ids.min()), int(read_ids.max())
    if low == high:  # (one split reading: most records)
        runs[:, :2] = reads[low]
    elif high - low <= len(runs):  # (a few readings close together: a table of them)
        runs[:, :2] = np.array(reads[low:high + 1], np.int64)[read_ids - low]
    else:
        for read in np.unique(read_ids).tolist():
            runs[read_ids == read, :2] = reads[read]
    return runs


@dataclass(slots=True)
class Origins:
    """The origins one record (or an epoch's END) carries, checked: its pass keys (by
    pass id), how many origins each element has (``counts``, or ``uniform`` for all), how
    many come first that no element holds (``loose``), the split ends, and the origins
    themselves: ``runs``, or ``codes`` with the ``reads`` they name."""

    keys: dict[int, Key]
    uniform: int
    counts: np.ndarray | None
    loose: int
    runs: np.ndarray  # int64 (n, 4): pass id, split, first index, length
    ends: list[tuple[Key, int, int, int]]
    reads: list[int] | None = None  # per read of ``codes``: read, pass id, split (flat)
    codes: np.ndarray | None = None  # int64: read << INDEX_BITS | index, in order
    groups: list[Group] | None = None  # groups formed since the last record

    def note(self, ledger: Ledger, elements: int | None = None) -> None:
        """Add the loose origins and those of the first ``elements`` elements (all when
        None), and the split ends, to ``ledger``."""
        held = None
        if elements is not None:
            held = self.loose + (self.uniform * elements if self.counts is None
                                 else int(self.counts[:elements].sum()))
        for group in self.groups or ():  # (its elements are held before any of its rows)
            ledger.define(group)
        if self.codes is not None and self.reads is not None:
            ledger.add_codes(self.keys, self.reads, self.codes[:held])
        else:
            ledger.add(self.keys, self.runs if held is None else _first(self.runs, held))
        for key, split, count, crc in self.ends:
            ledger.end(key, split, count, crc)


    def expanded(self, size: int) -> tuple[list[int], list[tuple[Key, int, int]]]:
        """Each origin of the record's ``size`` elements as (pass key, split, index), in
        order, the loose ones left out, and where each element's start among them (and
        ``size + 1``-th, their number): element ``i`` holds ``origins[starts[i]:
        starts[i + 1]]``. Python objects: for a few records (a group a consumer makes)."""
        counts = [self.uniform] * size if self.counts is None else self.counts.tolist()
        starts = [0, *itertools.accumulate(counts)]
        flat: list[tuple[Key, int, int]] = []
        if self.codes is not None and self.reads is not None:
            reads = self.reads
            table = {read: (self.keys[pass_id], split) for read, pass_id, split
                     in zip(reads[0::3], reads[1::3], reads[2::3], strict=True)}
            for code in self.codes[self.loose:].tolist():
                key, split = table[code >> INDEX_BITS]
                flat.append((key, split, code & INDEX_MASK))
        else:
            for pass_id, split, first, length in self.runs.tolist():
                key = self.keys[pass_id]
                flat.extend((key, split, first + at) for at in range(length))
            del flat[:self.loose]
        return starts, flat

    def note_some(self, ledger: Ledger, elements: Sequence[int], size: int) -> None:
        """Add the loose origins, those of the elements at ``elements`` (indices in this
        record of ``size`` elements, any order) and the split ends to ``ledger``: a
        record some of whose elements were yielded, maybe in another order than theirs
        (a consumer that draws a mix and shuffles what it draws)."""
        for group in self.groups or ():
            ledger.define(group)
        counts = (np.full(size, self.uniform, np.int64) if self.counts is None
                  else self.counts)
        starts = self.loose + np.concatenate(([0], np.cumsum(counts)[:-1])) \
            if len(counts) else np.empty(0, np.int64)
        chosen = np.asarray(elements, np.int64)
        lengths = counts[chosen]
        firsts = starts[chosen]
        # the positions of the chosen elements' origins among the record's, loose first
        positions = np.concatenate((np.arange(self.loose, dtype=np.int64),
                                    np.repeat(firsts - np.cumsum(lengths) + lengths, lengths)
                                    + np.arange(int(lengths.sum()), dtype=np.int64)))
        if self.codes is not None and self.reads is not None:
            ledger.add_codes(self.keys, self.reads, self.codes[positions])
        elif len(positions):
            runs = self.runs
            pass_ids = np.repeat(runs[:, 0], runs[:, 3])
            splits = np.repeat(runs[:, 1], runs[:, 3])
            indices = np.repeat(runs[:, 2] - np.cumsum(runs[:, 3]) + runs[:, 3], runs[:, 3]) \
                + np.arange(int(runs[:, 3].sum()), dtype=np.int64)
            picked = np.stack((pass_ids[positions], splits[positions], indices[positions],
                               np.ones(len(positions), np.int64)), axis=1)
            ledger.add(self.keys, picked)
        for key, split, count, crc in self.ends:
            ledger.end(key, split, count, crc)


def _first(runs: np.ndarray, origins: int) -> np.ndarray:
    """The runs of the first ``origins`` origins."""
    reach = np.cumsum(runs[:, 3])
    cut = int(np.searchsorted(reach, origins))
    if cut >= len(runs):
        return runs
    kept = runs[:cut + 1].copy()
    kept[-1, 3] -= int(reach[cut]) - origins
    return kept if kept[-1, 3] else kept[:-1]


def decode_origins(block: Any, elements: int) -> Origins:
    """Copy and check the origin block of a record of ``elements`` elements (a copy: it
    may lie in a ring that another process could still write, and it is read long after
    this check, when its elements are yielded).

    Raises:
        ValueError: it is malformed (the message says how).
    """
    view = memoryview(block).cast("B")
    if view.nbytes % 8 or view.nbytes < 8 * _HEAD:
        raise ValueError(f"an origin block is a whole number of int64s, at least {_HEAD}")
    # (a small block, a record of few elements: plain ints, no numpy call per part)
    small = view.nbytes <= 8 * SMALL_ORIGIN_BLOCK
    values: Any = view.cast("q").tolist() if small else np.frombuffer(view, np.int64)
    ints = list if small else np.ndarray.tolist  # (plain ints out of either)
    n, uniform, loose, nkeys, nends, nruns, nreads, ngrouped = head = ints(values[:_HEAD])
    if n != elements or uniform < -1 or loose < 0 \
            or min(nkeys, nends, nruns, nreads, ngrouped) < 0 \
            or max(nkeys, ngrouped) > len(values) or (nruns and nreads):
        raise ValueError(f"origin block head {head} does not fit a record of {elements} "
                         "elements")
    at = _HEAD
    counts = None
    if uniform == -1:
        counts = np.array(values[at:at + n], np.int64)
        at += n
        if len(counts) != n or (counts < 0).any():
            raise ValueError("origin counts must be >= 0, one per element")
    total = loose + (uniform * n if counts is None else int(counts.sum()))
    # The pass keys, split ends and reads as plain ints, taken at once (at most this long).
    front = ints(values[at:at + nkeys * (2 + MAX_KEY_LENGTH) + 4 * nends + ngrouped
                        + 3 * nreads])
    keys: dict[int, Key] = {}
    at = 0
    for _ in range(nkeys):
        pass_id, length = front[at:at + 2] if at + 2 <= len(front) else (-1, 0)
        key = front[at + 2:at + 2 + length]
        if not (0 <= pass_id < MAX_PASS_ID and 0 < length <= MAX_KEY_LENGTH
                and len(key) == length and min(key) >= 0) or pass_id in keys:
            raise ValueError("origin pass keys must be (pass id, length, key >= 0...)")
        keys[pass_id] = tuple(key)
        at += 2 + length
    origins_at = len(values) - (at + _HEAD + (n if counts is not None else 0))
    if origins_at != 4 * nends + ngrouped + (4 * nruns if not nreads else 3 * nreads + total):
        raise ValueError("origin block is not as long as its head says")
    ends = [(keys.get(p, ()), s, c, d)
            for p, s, c, d in zip(*[iter(front[at:at + 4 * nends])] * 4, strict=True)] \
        if nends else []
    if nends and any(not key or min(s, c, d) < 0 or s > INDEX_MASK for key, s, c, d in ends):
        raise ValueError("a split end names a pass the block does not, or is < 0")
    groups = (_groups_of(front[at + 4 * nends:at + 4 * nends + ngrouped], keys)
              if ngrouped else None)
    at += 4 * nends + ngrouped
    rest = values[len(values) - origins_at + 4 * nends + ngrouped:]  # runs, or reads and codes
    if nreads:
        reads = front[at:at + 3 * nreads]
        codes = np.array(rest[3 * nreads:], np.int64)
        _check_codes(reads, codes, keys)
        return Origins(keys, uniform, counts, loose, _NO_RUNS, ends, reads, codes, groups)
    runs = np.array(rest, np.int64).reshape(-1, 4)
    if (_check_runs(runs, keys) if nruns else 0) != total:
        raise ValueError("origin counts do not match the runs")
    return Origins(keys, uniform, counts, loose, runs, ends, groups=groups)


def _groups_of(values: list[int], keys: dict[int, Key]) -> list[Group]:
    """The groups of a block's group section, checked.

    Raises:
        ValueError: it is malformed.
    """
    groups = []
    at = 0
    while at < len(values):
        head = values[at:at + 6]
        if len(head) < 6:
            raise ValueError("a block's group is cut short")
        pass_id, split, index, position, rows, nruns = head
        runs = values[at + 6:at + 6 + 4 * nruns]
        at += 6 + 4 * nruns
        if pass_id not in keys or not (0 <= split <= INDEX_MASK and 0 <= index <= INDEX_MASK
                                       and position >= 1 and rows >= 1 and nruns >= 1) \
                or len(runs) != 4 * nruns:
            raise ValueError("a block's group must be (pass, split, index, position >= 1, "
                             "rows >= 1, runs >= 1) of a pass the block names")
        members = []
        for run_pass, run_split, first, length in zip(*[iter(runs)] * 4, strict=True):
            if run_pass not in keys or not (0 <= run_split <= INDEX_MASK and first >= 0
                                            and length >= 1
                                            and first + length <= INDEX_MASK + 1):
                raise ValueError("a block's group member run names a pass the block does "
                                 "not, or indices outside [0, 2**32)")
            members.append((keys[run_pass], run_split, first, length))
        if sum(run[3] for run in members) > MAX_GROUP_MEMBERS \
                or members[0][:3] != (keys[pass_id], split, index):
            raise ValueError("a block's group must start with its anchor and hold at most "
                             f"{MAX_GROUP_MEMBERS} elements")
        groups.append(Group(keys[pass_id], split, index, position, rows, tuple(members)))
    return groups


_NO_RUNS = np.empty((0, 4), np.int64)
_NO_RUNS.flags.writeable = False


def _check_codes(table: list[int], codes: np.ndarray, keys: dict[int, Key]) -> None:
    """Check a block's codes against its table of reads (read, pass id, split, flat):
    distinct reads below 2**31 of known passes and splits, and each code of a read the
    table names."""
    ids = table[0::3]
    if len(ids) == 1:  # (most blocks)
        read, pass_id, split = table
        bad = not _read_ok(read, pass_id, split, keys)
    else:
        bad = len(set(ids)) != len(ids) or not all(
            map(_read_ok, ids, table[1::3], table[2::3], itertools.repeat(keys)))
    if bad:
        raise ValueError("an origin read must be (read, pass id, split), distinct reads "
                         "< 2**31 of passes the block names")
    if not len(codes):
        return
    low, high = int(np.minimum.reduce(codes)), int(np.maximum.reduce(codes))
    first, last = min(ids), max(ids)
    if low < 0 or not (low >> INDEX_BITS >= first and high >> INDEX_BITS <= last) or (
            last - first + 1 != len(ids)  # (reads with gaps: each code looked up)
            and not np.isin(codes >> INDEX_BITS, ids).all()):
        raise ValueError("an origin code names a read the block's table does not")


def _read_ok(read: int, pass_id: int, split: int, keys: dict[int, Key]) -> bool:
    """Whether (read, pass id, split) can be a row of a block's table of reads."""
    return 0 <= read <= MAX_READ and pass_id in keys and 0 <= split <= INDEX_MASK


def _check_runs(runs: np.ndarray, keys: dict[int, Key]) -> int:
    """How many origins ``runs`` hold, once checked: known passes, splits and indices
    below 2**32, lengths >= 1 (few runs in Python, many at numpy speed)."""
    if len(runs) <= 8:
        total = 0
        for pass_id, split, start, length in runs.tolist():
            if pass_id not in keys or not 0 <= split <= INDEX_MASK or start < 0 \
                    or length < 1 or start + length > INDEX_MASK + 1:
                raise ValueError("an origin run names a pass the block does not, or "
                                 "indices outside [0, 2**32)")
            total += length
        return total
    if (runs < 0).any() or (runs[:, 3] < 1).any() \
            or not set(_distinct(runs[:, 0])) <= keys.keys() \
            or int(runs[:, 1].max()) > INDEX_MASK \
            or int((runs[:, 2] + runs[:, 3]).max()) > INDEX_MASK + 1:
        raise ValueError("an origin run names a pass the block does not, or indices "
                         "outside [0, 2**32)")
    return int(runs[:, 3].sum())


# --- sets of small ints as short strings ---------------------------------------------------


def pack(values: Iterable[int]) -> str:
    """A set of ints >= 0 as base64 of a compressed bitmap."""
    array = values if isinstance(values, np.ndarray) else np.fromiter(values, np.int64)
    if not len(array):
        return ""
    mask = np.zeros(int(array.max()) + 1, bool)
    mask[array] = True
    return base64.b64encode(zlib.compress(np.packbits(mask).tobytes())).decode()


def unpack(text: Any, limit: int = 1 << 32) -> set[int]:
    """The set :func:`pack` made.

    Raises:
        ValueError: ``text`` is not one (or holds more than ``limit`` bits).
    """
    if text == "":
        return set()
    if not isinstance(text, str):
        raise ValueError(f"a packed set must be a string, not {type(text).__name__}")
    try:
        raw = zlib.decompressobj().decompress(base64.b64decode(text, validate=True),
                                              limit // 8 + 1)
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"not a packed set: {exc}") from None
    return set(np.flatnonzero(np.unpackbits(np.frombuffer(raw, np.uint8))).tolist())


def merge_info(held: dict[str, Any] | None, info: Any) -> dict[str, Any]:
    """Add one consumer's :meth:`Ledger.info` for a split to what others said (``all``, or
    the union of the indices held, as a set, and the first reading's ``expect``).

    Raises:
        ValueError: ``info`` is malformed.
    """
    if not isinstance(info, dict):
        raise ValueError("a split's info must be an object")
    if (held or {}).get("all") or info.get("all") is True:
        return {"all": True}
    expect = info.get("expect")
    if expect is not None and not (isinstance(expect, list) and len(expect) == 2
                                   and all(isinstance(v, int) for v in expect)):
        raise ValueError("expect must be [count, digest]")
    merged = dict(held or {"have": set()})
    merged["have"] = merged["have"] | unpack(info.get("have", ""))
    if expect is not None:
        merged["expect"] = expect
    if info.get("groups") is not None:
        ledger = Ledger()  # (groups merged by id: the rows each consumer held, together)
        ledger.merge_groups(merged.get("groups", []))
        ledger.merge_groups(info["groups"])
        merged["groups"] = ledger.open_groups()
    return merged


# --- the consumer's ledger -------------------------------------------------------------------


def merge_runs(runs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The union of ``runs`` ((pass id, split, first index, length) rows, in any order,
    overlapping or not) as sorted, disjoint, non-touching ranges: their places (``pass id
    << INDEX_BITS | split``), starts and ends, ordered by place then start.

    At least MERGE_COUNT_RUNS runs of few places whose indices lie close together (a
    shuffle's scattered origins, many runs of one) are merged by counting, in time linear
    in the runs and their span (:func:`_covered`); any others by one sort of the rows, then
    whole-array operations."""
    pass_ids, splits = runs[:, 0], runs[:, 1]
    starts, ends = runs[:, 2], runs[:, 2] + runs[:, 3]
    places = pass_ids << INDEX_BITS | splits
    merged: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for place, rows in _few_places(places) if len(runs) >= MERGE_COUNT_RUNS else ():
        covered = _covered(starts if rows is None else starts[rows],
                           ends if rows is None else ends[rows])
        if covered is None:
            merged = []
            break
        merged.append((np.full(len(covered[0]), place, np.int64), *covered))
    if merged:
        return (np.concatenate([m[0] for m in merged]), np.concatenate([m[1] for m in merged]),
                np.concatenate([m[2] for m in merged]))
    return _merged_by_sort(pass_ids, splits, starts, ends)


def _few_places(places: np.ndarray) -> list[tuple[int, np.ndarray | None]]:
    """The distinct places of ``places`` (sorted), each with a mask of its rows (None:
    every row); empty when there are more than MERGE_PLACES of them."""
    first = int(places[0])
    if (places == first).all():  # (the usual fold: one split under way)
        return [(first, None)]
    candidates = np.unique(places[::max(1, len(places) // 256)]).tolist()
    if len(candidates) > MERGE_PLACES:
        return []
    groups = [(place, places == place) for place in candidates]
    if sum(int(rows.sum()) for _, rows in groups) != len(places):
        return []  # a place the sample missed
    return groups


def _covered(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The ``[start, end)`` ranges that runs of one place cover, sorted and disjoint, by
    counting how many runs cover each index of their span; None when the span is more
    than MERGE_SPAN_FACTOR times the runs (plus MERGE_SPAN_SLACK): sparse runs sort faster."""
    low, high = int(starts.min()), int(ends.max())
    span = high - low
    if span > MERGE_SPAN_FACTOR * len(starts) + MERGE_SPAN_SLACK:
        return None
    depth = (np.bincount(starts - low, minlength=span + 1)
             - np.bincount(ends - low, minlength=span + 1))
    inside = np.cumsum(depth[:span]) > 0
    edges = np.flatnonzero(np.diff(inside.view(np.int8), prepend=0, append=0)) + low
    return edges[0::2], edges[1::2]


def _merged_by_sort(pass_ids: np.ndarray, splits: np.ndarray, starts: np.ndarray,
                    ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`merge_runs` by one sort of the rows (of one int64 key each where the ids
    allow: the usual case), then whole-array operations."""
    if int(pass_ids.max()) < 1 << 10 and int(splits.max()) < 1 << 20:
        # one key of 63 bits: pass id (10), split (20), start (33)
        place = pass_ids << 20 | splits
        order = np.argsort(place << (INDEX_BITS + 1) | starts)
    else:
        order = np.lexsort((starts, splits, pass_ids))
    places = (pass_ids << INDEX_BITS | splits)[order]
    starts, ends = starts[order], ends[order]
    # Ends made to grow across places too (a place's rows all lie above the last's), so
    # that one running maximum finds each range's reach.
    rank = np.r_[0, np.cumsum(places[1:] != places[:-1])]
    reach = np.maximum.accumulate(rank << (INDEX_BITS + 1) | ends)
    first = np.flatnonzero(np.r_[True, (rank[1:] << (INDEX_BITS + 1) | starts[1:]) > reach[:-1]])
    last = np.r_[first[1:] - 1, len(starts) - 1]
    return places[first], starts[first], reach[last] & ((1 << (INDEX_BITS + 1)) - 1)


def _code_runs(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of consecutive values of sorted ``codes`` (``place << INDEX_BITS |
    index``): their places, first indices and ends. A value repeated starts a run again."""
    breaks = np.diff(codes) != 1
    while True:
        bounds = np.concatenate(([0], np.flatnonzero(breaks) + 1, [len(codes)]))
        heads = codes[bounds[:-1]]
        starts = heads & INDEX_MASK
        ends = starts + np.diff(bounds)
        if int(ends.max()) <= INDEX_MASK + 1:
            return heads >> INDEX_BITS, starts, ends
        breaks |= (codes[1:] & INDEX_MASK) == 0  # (a run went on into the next place)


class Ranges:
    """A set of ints >= 0 as sorted, disjoint, non-touching ``[start, end)`` ranges, with
    its size: what a consumer holds of one split. Elements of a split mostly come in
    order, so adding the next run extends the last range; others merge at numpy speed."""

    __slots__ = ("count", "ends", "starts")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.count = 0

    @classmethod
    def of(cls, indices: Iterable[int]) -> Ranges:
        """The ranges of a set of indices."""
        ranges = cls()
        values = np.unique(np.fromiter(indices, np.int64))
        if len(values):
            cuts = np.flatnonzero(np.diff(values) != 1) + 1
            ranges.add(values[np.r_[0, cuts]], values[np.r_[cuts - 1, len(values) - 1]] + 1)
        return ranges

    def add(self, starts: np.ndarray, ends: np.ndarray) -> None:
        """Add the ranges ``[starts[i], ends[i])`` (they may overlap anything held)."""
        if len(starts) <= SMALL_ORIGIN_BLOCK:  # (few: in order, each extends the last)
            for at, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(),
                                                  strict=True)):
                if not self.add_run(start, end):
                    starts, ends = starts[at:], ends[at:]
                    break
            else:
                return
        all_starts = np.concatenate((np.array(self.starts, np.int64), starts))
        all_ends = np.concatenate((np.array(self.ends, np.int64), ends))
        order = np.argsort(all_starts, kind="stable")
        all_starts, reach = all_starts[order], np.maximum.accumulate(all_ends[order])
        first = np.flatnonzero(np.r_[True, all_starts[1:] > reach[:-1]])
        merged_starts = all_starts[first]
        merged_ends = reach[np.r_[first[1:] - 1, len(all_starts) - 1]]
        self.starts, self.ends = merged_starts.tolist(), merged_ends.tolist()
        self.count = int((merged_ends - merged_starts).sum())

    def add_run(self, start: int, end: int) -> bool:
        """Add ``[start, end)`` if it lies after every range held (the usual case);
        False if it does not (then nothing changed)."""
        if not self.ends or start > self.ends[-1]:
            self.starts.append(start)
            self.ends.append(end)
        elif start == self.ends[-1]:
            self.ends[-1] = end
        else:
            return False
        self.count += end - start
        return True

    def indices(self) -> np.ndarray:
        """Every index held, in order."""
        if not self.starts:
            return np.empty(0, np.int64)
        return np.concatenate([np.arange(a, b) for a, b in zip(self.starts, self.ends,
                                                                strict=True)])


class _Rows:
    """What a ledger holds of one :class:`Group`: the group (None while only rows of it
    came, a ``job_name`` consumer's) and the rows held."""

    __slots__ = ("group", "have")

    def __init__(self) -> None:
        self.group: Group | None = None
        self.have = Ranges()


class Ledger:
    """Origins of one epoch received (or yielded) by a consumer: per pass, the splits
    accounted for whole, and the :class:`Ranges` of indices held of the others; with each
    split's (count, digest) once its worker finished reading it.

    A :class:`Group`'s elements are held from when the group is known (a record names
    it); its split is not accounted for whole until every row of the group is held: a
    row missing is made again from the group's elements (:meth:`info` names it)."""

    def __init__(self, made_here: int = 0) -> None:
        # Groups whose unbatch is at this position or after are made by the consumer
        # that draws a mix (zloader/client/draw.py): a ledger of what it *received*
        # ignores them (their rows never come in a record); 0: none.
        self.made_here = made_here
        self._done: dict[Key, set[int]] = {}
        self._open: dict[tuple[Key, int], Ranges] = {}
        self._lengths: dict[tuple[Key, int], tuple[int, int]] = {}
        # Records' origins not yet added (:meth:`add` and :meth:`add_codes` keep them to
        # add many at once), and how many runs and codes they hold.
        self._pending: list[tuple[dict[int, Key], np.ndarray]] = []
        self._pending_codes: list[tuple[dict[int, Key], list[int], np.ndarray]] = []
        self._pending_runs = 0
        # (pass, split) by number, for codes made the ledger's own (:meth:`_fold_codes`)
        self._places: dict[tuple[Key, int], int] = {}
        self._place_of: list[tuple[Key, int]] = []
        # Groups whose rows are not all held, by id; the ids of those by their anchor's
        # split (which stays open meanwhile); those whose rows all came.
        self._groups: dict[tuple[Key, int, int, int], _Rows] = {}
        self._anchored: dict[tuple[Key, int], set[tuple[Key, int, int, int]]] = {}
        self._whole: set[tuple[Key, int, int, int]] = set()
        # Those by their anchor's split while it is open: a state lists them, so that a
        # state of another consumer that holds only some of their rows does not have
        # them made again when the two are resumed together.
        self._whole_at: dict[tuple[Key, int], set[tuple[Key, int, int, int]]] = {}
        # Every group known this epoch: a group holding rows of others is made again
        # from theirs (zloader/groups.py), whole or not.
        self._defs: dict[tuple[Key, int, int, int], Group] = {}

    @property
    def done(self) -> dict[Key, set[int]]:
        """The splits accounted for whole, by pass."""
        self._fold()
        return self._done

    @property
    def open(self) -> dict[tuple[Key, int], Ranges]:
        """The indices held of the splits not accounted for whole."""
        self._fold()
        return self._open

    def add(self, keys: dict[int, Key], runs: np.ndarray) -> None:
        """Note the origins ``runs`` ((pass id, split, first index, length) rows;
        ``keys[id]`` is the pass). They are kept and added LEDGER_FOLD_RECORDS records at
        a time (or when the ledger is read): one merge per split for many records."""
        if len(runs):
            self._pending.append((keys, runs))
            self._kept(len(runs))

    def add_codes(self, keys: dict[int, Key], reads: list[int], codes: np.ndarray) -> None:
        """Note the origins ``codes`` (``read << INDEX_BITS | index``, each of a read that
        ``reads``, (read, pass id, split) flat, names), kept as :meth:`add` keeps runs."""
        if len(codes):
            self._pending_codes.append((keys, reads, codes))
            self._kept(len(codes))

    def _kept(self, runs: int) -> None:
        self._pending_runs += runs
        if len(self._pending) + len(self._pending_codes) >= LEDGER_FOLD_RECORDS \
                or self._pending_runs >= LEDGER_FOLD_RUNS:
            self._fold()

    def _fold(self) -> None:
        """Add the records' origins kept by :meth:`add` and :meth:`add_codes`."""
        pending, codes = self._pending, self._pending_codes
        self._pending, self._pending_codes, self._pending_runs = [], [], 0
        if len(pending) == 1:
            self._add_runs(*pending[0])
        elif pending:
            self._fold_runs(pending)
        if codes:
            self._fold_codes(codes)

    def _fold_runs(self, pending: list[tuple[dict[int, Key], np.ndarray]]) -> None:
        """Add the runs of many records, their pass ids made one table."""
        table: dict[Key, int] = {}
        parts = []
        for keys, runs in pending:
            ids = {pass_id: table.setdefault(key, len(table)) for pass_id, key in keys.items()}
            if any(pass_id != number for pass_id, number in ids.items()):
                lookup = np.zeros(max(ids) + 1, np.int64)
                lookup[list(ids)] = list(ids.values())
                runs = np.column_stack((lookup[runs[:, 0]], runs[:, 1:]))
            parts.append(runs)
        self._add_runs({number: key for key, number in table.items()}, np.concatenate(parts))

    def _fold_codes(self, pending: list[tuple[dict[int, Key], list[int], np.ndarray]]) -> None:
        """Add the codes of many records: each record's reads made the ledger's numbers
        for its (pass, split)s, then one sort of them all, whose runs of consecutive codes
        are the ranges to add."""
        single, shifts, parts = [], [], []  # (records of one split reading, then others)
        for keys, reads, codes in pending:
            if len(reads) == 3:  # (one split reading, most records: shifted all at once below)
                single.append(codes)
                shifts.append((self._place(keys[reads[1]], reads[2]) - reads[0]) << INDEX_BITS)
                continue
            places = [self._place(keys[pass_id], split)
                      for pass_id, split in zip(reads[1::3], reads[2::3], strict=True)]
            ids = np.array(reads[0::3], np.int64)
            order = np.argsort(ids)
            at = np.searchsorted(ids[order], codes >> INDEX_BITS)
            parts.append(np.array(places, np.int64)[order][at] << INDEX_BITS
                         | codes & INDEX_MASK)
        if single:
            codes = np.concatenate(single)
            codes += np.repeat(np.array(shifts, np.int64), list(map(len, single)))
            parts.append(codes)
        merged = np.concatenate(parts) if len(parts) > 1 else parts[0]
        merged.sort()
        numbers, starts, ends = _code_runs(merged)
        cuts = np.flatnonzero(np.diff(numbers)) + 1
        for at, stop in zip(np.concatenate(([0], cuts)).tolist(),
                            np.concatenate((cuts, [len(numbers)])).tolist(), strict=True):
            key, split = self._place_of[int(numbers[at])]
            self._add(key, split, starts[at:stop], ends[at:stop])

    def _place(self, key: Key, split: int) -> int:
        """The ledger's number for ``split`` of pass ``key``."""
        number = self._places.get((key, split))
        if number is None:
            number = self._places[(key, split)] = len(self._place_of)
            self._place_of.append((key, split))
        return number

    def _add_runs(self, keys: dict[int, Key], runs: np.ndarray) -> None:
        if len(runs) == 1:  # (consecutive elements of one split)
            pass_id, split, start, length = runs[0].tolist()
            key = keys[pass_id]
            held = self._open.get((key, split))
            if held is not None and held.add_run(start, start + length):
                self._close(key, split)
                return
            self._add(key, split, runs[:, 2], runs[:, 2] + length)
            return
        places, starts, ends = merge_runs(runs)
        cuts = np.flatnonzero(np.diff(places)) + 1
        for at, stop in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(places)].tolist(),
                            strict=True):
            place = int(places[at])
            self._add(keys[place >> INDEX_BITS], place & INDEX_MASK, starts[at:stop],
                      ends[at:stop])

    def _add(self, key: Key, split: int, starts: np.ndarray, ends: np.ndarray) -> None:
        if len(key) > 2 and key[-2] >= GROUP_KEY:  # (rows of a group)
            self._rows(key, split, starts, ends)
            return
        if split in self._done.get(key, ()):
            return
        held = self._open.get((key, split))
        if held is None:
            held = self._open[(key, split)] = Ranges()
        held.add(starts, ends)
        self._close(key, split)

    def define(self, group: Group, rows: Iterable[int] = ()) -> None:
        """Note ``group`` (a record named it): its elements are held, and its anchor's
        split stays open until all its rows are; ``rows``: rows of it held already. A
        group made from :attr:`made_here` on is left out."""
        if self.made_here and group.position >= self.made_here:
            return
        gid = group.id
        held = self._groups.get(gid)
        if held is not None and held.group is not None and not rows:
            return  # (known already: a record names the groups of every row it holds)
        for one in (group, *group.inner):
            self._defs.setdefault(one.id, one)
        held = self._group(gid)
        if held is None:
            return
        if held.group is None:
            held.group = group
            for key, split, first, length in group.members:
                inner = group_of_rows(key, split)
                if inner is None:
                    self._add(key, split, np.array([first], np.int64),
                              np.array([first + length], np.int64))
                elif inner in self._groups:  # (rows of a group still open here)
                    self._group_rows(inner, self._groups[inner], range(first, first + length))
        self._group_rows(gid, held, rows)

    def _group(self, gid: tuple[Key, int, int, int]) -> _Rows | None:
        """What is held of the group ``gid``, made on first sight; None once all its rows
        came or its split was accounted for whole."""
        held = self._groups.get(gid)
        if held is None:
            anchor = anchor_split(gid[0], gid[1])
            if gid in self._whole or anchor[1] in self._done.get(anchor[0], ()):
                return None
            held = self._groups[gid] = _Rows()
            self._anchored.setdefault(anchor, set()).add(gid)
        return held

    def _rows(self, key: Key, split: int, starts: np.ndarray, ends: np.ndarray) -> None:
        """Rows of a group: ``key`` and ``split`` are its :attr:`Group.rows_key`."""
        gid = group_of_rows(key, split)
        assert gid is not None
        held = self._group(gid)
        if held is not None:
            held.have.add(starts, ends)
            self._group_rows(gid, held, ())

    def _group_rows(self, gid: tuple[Key, int, int, int], held: _Rows,
                    rows: Iterable[int]) -> None:
        """Add ``rows`` to the group ``gid``; close it once all its rows are held."""
        if rows:
            more = Ranges.of(rows)
            if more.starts:
                held.have.add(np.array(more.starts, np.int64), np.array(more.ends, np.int64))
        if held.group is None or held.have.count < held.group.rows:
            return
        del self._groups[gid]
        self._whole.add(gid)
        anchor = anchor_split(gid[0], gid[1])
        self._whole_at.setdefault(anchor, set()).add(gid)
        waiting = self._anchored.get(anchor)
        if waiting is not None:
            waiting.discard(gid)
            if not waiting:
                del self._anchored[anchor]
                self._close(*anchor)

    def groups(self, key: Key, split: int, whole: bool = False) -> list[list[Any]]:
        """The groups anchored in ``split`` of pass ``key`` whose rows are not all held,
        as :meth:`Group.to_json` gives them (``rows`` -1 and no members for a group of
        which only rows came); ``whole``: and those whose rows all are (a state's)."""
        self._fold()
        out = []
        for gid in sorted(self._whole_at.get((key, split), ())) if whole else ():
            group = self._defs.get(gid)
            if group is not None:
                out.append(group.to_json(range(group.rows)))
        for gid in sorted(self._anchored.get((key, split), ())):
            held = self._groups[gid]
            if held.group is not None:
                out.append(held.group.to_json(held.have.indices().tolist(),
                                              self._inner(held.group)))
            else:
                out.append([list(gid[0]), gid[1], gid[3], gid[2], -1, [],
                            pack(held.have.indices())])
        return out

    def _inner(self, group: Group) -> list[Group]:
        """The groups whose rows ``group`` holds, and theirs, as far as known."""
        found: dict[tuple[Key, int, int, int], Group] = {}
        waiting = [group]
        while waiting:
            for key, split, _, _ in waiting.pop().members:
                gid = group_of_rows(key, split)
                if gid is None or gid in found or gid not in self._defs:
                    continue
                found[gid] = self._defs[gid]
                waiting.append(found[gid])
        return list(found.values())

    def open_groups(self) -> list[list[Any]]:
        """:meth:`groups` of every split with a group whose rows are not all held."""
        return [group for key, split in sorted(self._anchored)
                for group in self.groups(key, split)]

    def merge_groups(self, groups: Any) -> None:
        """Add groups as :meth:`groups` gives them (of this ledger or another's).

        Raises:
            ValueError: ``groups`` is not such a value.
        """
        if not isinstance(groups, list):
            raise ValueError("a split's groups must be a list")
        for value in groups:
            group, gid, rows = Group.from_json(value)
            if group is not None:
                self.define(group, rows)
            else:
                held = self._group(gid)
                if held is not None:
                    self._group_rows(gid, held, rows)

    def add_indices(self, key: Key, split: int, indices: Iterable[int]) -> None:
        """Note indices of one split (from a packed set)."""
        self._fold()
        if split in self._done.get(key, ()):
            return
        held = Ranges.of(indices)
        ranges = self._open.setdefault((key, split), Ranges())
        if held.starts:
            ranges.add(np.array(held.starts, np.int64), np.array(held.ends, np.int64))
        self._close(key, split)

    def end(self, key: Key, split: int, count: int, crc: int) -> None:
        """The split's worker read ``count`` elements from it (with digest ``crc``)."""
        self._fold()
        if split not in self._done.get(key, ()):
            self._lengths[(key, split)] = (count, crc)
            self._close(key, split)

    def missing(self, epoch: int, handed: Any) -> set[tuple[Key, int]]:
        """The splits of ``epoch`` not accounted for whole: begun here and not finished
        (fewer elements than their count), or handed out by the broker (``handed``: its
        ``JOB.read``, ``[[pass, packed splits], ...]``) and never finished here. Malformed
        entries of ``handed`` are ignored."""
        self._fold()
        missing = {at for at in self._open if at[0][0] == epoch}
        for entry in handed if isinstance(handed, list) else ():
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                    and entry[0] and entry[0][0] == epoch):
                continue
            key = tuple(entry[0])
            try:
                missing |= {(key, split) for split in unpack(entry[1])
                            - self._done.get(key, set())}
            except ValueError:
                continue
        return missing

    def _close(self, key: Key, split: int) -> None:
        length = self._lengths.get((key, split))
        if length is not None and (key, split) not in self._anchored:
            held = self._open.get((key, split))
            if (held.count if held is not None else 0) >= length[0]:
                self._done.setdefault(key, set()).add(split)
                self._open.pop((key, split), None)
                self._lengths.pop((key, split), None)
                self._whole_at.pop((key, split), None)

    def held(self, key: Key, split: int) -> np.ndarray:
        """The indices of an open split held."""
        self._fold()
        ranges = self._open.get((key, split))
        return ranges.indices() if ranges is not None else np.empty(0, np.int64)

    def info(self, key: Key, split: int) -> dict[str, Any]:
        """What the broker needs to hand ``split`` out again: ``all`` when it is accounted
        for, else the indices held (``have``) and the first reading's ``expect``."""
        self._fold()
        if split in self._done.get(key, ()):
            return {"all": True}
        info: dict[str, Any] = {"have": pack(self.held(key, split))}
        if (key, split) in self._lengths:
            info["expect"] = list(self._lengths[(key, split)])
        groups = self.groups(key, split)
        if groups:
            info["groups"] = groups
        return info

    def to_json(self) -> list[Any]:
        """Per pass: ``[pass, done splits, [[split, held indices, count, digest], ...]]``
        (count and digest -1 while unknown), and a fourth item, the groups anchored in
        the pass whose rows are not all held (:meth:`groups`), when there are any."""
        self._fold()
        keys = set(self._done) | {key for key, _ in self._open} | {k for k, _ in self._anchored} \
            | {k for k, _ in self._whole_at}
        out = []
        for key in sorted(keys):
            opened = [[split, pack(self.held(k, split)), *self._lengths.get((k, split), (-1, -1))]
                      for (k, split) in sorted(self._open) if k == key]
            entry = [list(key), pack(self._done.get(key, ())), opened]
            groups = [group for (k, split) in sorted(set(self._anchored) | set(self._whole_at))
                      if k == key for group in self.groups(k, split, whole=True)]
            if groups:
                entry.append(groups)
            out.append(entry)
        return out

    def merge_json(self, passes: Any) -> None:
        """Add what :meth:`to_json` returned (of this ledger or another's).

        Raises:
            ValueError: ``passes`` is not such a value.
        """
        self._fold()
        if not isinstance(passes, list):
            raise ValueError("the delivered origins must be a list of passes")
        for entry in passes:
            if not (isinstance(entry, list) and len(entry) in (3, 4)
                    and isinstance(entry[0], list)
                    and all(_natural(k) for k in entry[0]) and isinstance(entry[2], list)):
                raise ValueError(f"bad pass entry in the delivered origins: {entry!r:.80}")
            key = tuple(entry[0])
            for split in unpack(entry[1]):
                self._done.setdefault(key, set()).add(split)
                self._open.pop((key, split), None)
                self._lengths.pop((key, split), None)
            if len(entry) == 4:  # (first: a split with a group open must not close below)
                self.merge_groups(entry[3])
            for item in entry[2]:
                if not (isinstance(item, list) and len(item) == 4 and _natural(item[0])
                        and all(isinstance(v, int) for v in item[2:])):
                    raise ValueError(f"bad split entry in the delivered origins: {item!r:.80}")
                split = item[0]
                if split in self._done.get(key, ()):
                    continue
                if item[2] >= 0:
                    self._lengths[(key, split)] = (item[2], item[3])
                self.add_indices(key, split, unpack(item[1]))
                self._close(key, split)


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_key(value: Any) -> bool:
    """Whether ``value`` is a pass key as JSON has it: a non-empty list of ints >= 0."""
    return (isinstance(value, list) and 0 < len(value) <= MAX_KEY_LENGTH
            and all(map(_natural, value)))
