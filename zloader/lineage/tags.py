"""Origins at read time: how a worker tags each source element, and how stages gather
the tags of a batch's rows.

A source element's origin is a code, ``read << INDEX_BITS | index`` (:func:`code`): the
producer's ``read``-th split reading and the element's index in that split. A worker reads
a split tagged (:func:`read_split_chunks`), skipping the indices a consumer already holds,
and checks the count and a digest of what it read against the first reading.
"""

from __future__ import annotations

import base64
import itertools
import operator
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from zloader._defaults import (
    GROUP_KEY,
    LIGHT_BYTES,
    LIGHT_ITEMS,
    MAX_GROUP_MEMBERS,
    READ_AHEAD_SECONDS,
)
from zloader.errors import PipelineError
from zloader.lineage.intsets import pack, unpack

__all__ = ["DIGEST_BYTES", "DIGEST_GROUP", "DIGEST_MARK", "INDEX_BITS", "INDEX_MASK",
           "MAX_KEY_LENGTH", "MAX_PASS_ID", "MAX_READ", "Assigned", "Group", "Key",
           "MemberRuns", "Origin", "Tagged", "anchor_split", "code", "digest",
           "exactly_once", "flat_runs", "gather", "group_of_rows", "is_pass_key", "light",
           "natural", "packed_runs", "read_split", "read_split_chunks", "split_tags", "take",
           "untag"]


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


class MemberRuns(Sequence[tuple[Key, int, int, int]]):
    """A group's member runs, (pass key, split, first index, length) each, kept as one
    flat tuple: a consumer holds thousands of groups of single shuffled elements at once
    (a tokenizer's after a shuffle), and a tuple per run was an object per element to
    make, keep and free (a group of 64 elements: 3.8 KB, not 6.9; the trainer's CPU under
    exactly-once about 10% less). Iterates, compares and hashes as the tuple of runs."""

    __slots__ = ("flat",)

    def __init__(self, flat: tuple[Any, ...]) -> None:
        self.flat = flat

    def __len__(self) -> int:
        return len(self.flat) // 4

    def __iter__(self) -> Iterator[tuple[Key, int, int, int]]:
        return zip(*[iter(self.flat)] * 4, strict=True)

    def __getitem__(self, at: Any) -> Any:
        runs = tuple(self)
        return runs[at]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MemberRuns):
            return self.flat == other.flat
        return isinstance(other, tuple) and tuple(self) == other

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


def flat_runs(members: Sequence[tuple[Key, int, int, int]]) -> tuple[Any, ...]:
    """``members`` (a group's) flat: key, split, first, length, key, ..."""
    return members.flat if isinstance(members, MemberRuns) \
        else tuple(itertools.chain.from_iterable(members))


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
            length) runs (a tuple of them, or :class:`MemberRuns`); a run in the pass of
            another group's rows (:attr:`rows_key`) names rows of that group (a packer
            after a batched tokenizer).
        inner: the groups whose rows it holds, and theirs, to make it again (not part
            of what names it).
    """

    key: Key
    split: int
    index: int
    position: int
    rows: int
    members: Sequence[tuple[Key, int, int, int]]
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
        """``[key, split, index, position, rows, members, have]`` (``members``: its
        runs packed, :func:`packed_runs`; ``have``: the rows held, packed), and the
        ``inner`` groups as an eighth item when there are any."""
        value = [list(self.key), self.split, self.index, self.position, self.rows,
                 packed_runs(self.members), pack(have)]
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
        if not (isinstance(value, list) and len(value) in (7, 8) and is_pass_key(value[0])
                and all(natural(v) for v in value[1:4]) and isinstance(value[4], int)
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
        members = _unpacked_runs(runs) if len(runs) == 2 and isinstance(runs[1], str) \
            else _member_runs(runs)
        if not 1 <= rows <= MAX_GROUP_MEMBERS * 64 or not members \
                or sum(members.flat[3::4]) > MAX_GROUP_MEMBERS \
                or members.flat[:3] != (gid[0], split, index):
            raise ValueError(f"a group must have rows >= 1 and start with its anchor, got "
                             f"{value!r:.80}")
        if held and max(held) >= rows:
            raise ValueError(f"a group's rows held must be below its {rows} rows")
        return cls(gid[0], split, index, position, rows, members, tuple(inner)), gid, held


def packed_runs(members: Sequence[tuple[Key, int, int, int]]) -> list[Any]:
    """A group's member runs as JSON holds them: ``[pass keys, packed]``, the runs as
    int64s ``(key's place in the list, split, first, length)``, compressed, in base64. A
    state lists thousands of groups of shuffled elements, one run each: a list per run
    made a 2 MB state take the broker a second to parse; this is one string a group."""
    flat = list(flat_runs(members))
    keys = list(dict.fromkeys(flat[0::4]))
    numbers = {key: at for at, key in enumerate(keys)}
    flat[0::4] = map(numbers.__getitem__, flat[0::4])
    raw = np.array(flat, "<i8").tobytes()
    return [[list(key) for key in keys], base64.b64encode(zlib.compress(raw, 1)).decode()]


def _unpacked_runs(value: list[Any]) -> MemberRuns:
    """The member runs :func:`packed_runs` made, checked.

    Raises:
        ValueError: ``value`` is not such a value.
    """
    keys, text = value
    if not (isinstance(keys, list) and 0 < len(keys) <= MAX_GROUP_MEMBERS
            and all(map(is_pass_key, keys))):
        raise ValueError(f"a group's packed member runs must name their pass keys, got "
                         f"{keys!r:.80}")
    stream = zlib.decompressobj()
    try:
        raw = stream.decompress(base64.b64decode(text, validate=True),
                                32 * MAX_GROUP_MEMBERS + 1)
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"a group's packed member runs are not packed runs: {exc}") from None
    if not stream.eof or stream.unused_data:  # (cut short, or more after it)
        raise ValueError("a group's packed member runs are not one whole zlib stream")
    if not raw or len(raw) % 32 or len(raw) > 32 * MAX_GROUP_MEMBERS:
        raise ValueError(f"a group's packed member runs hold {len(raw)} bytes, not a "
                         f"whole number of runs of 32 (at most {MAX_GROUP_MEMBERS})")
    runs = np.frombuffer(raw, "<i8").reshape(-1, 4)
    places, splits, firsts, lengths = runs.T
    if not ((places >= 0).all() and (places < len(keys)).all() and (splits >= 0).all()
            and (splits <= INDEX_MASK).all() and (firsts >= 0).all()
            and (firsts <= INDEX_MASK).all() and (lengths >= 1).all()
            and (firsts + np.minimum(lengths, INDEX_MASK + 1) <= INDEX_MASK + 1).all()):
        raise ValueError("a group's packed member runs must be (pass key's place, split, "
                         "first, length) with indices in [0, 2**32) and lengths >= 1")
    flat = runs.ravel().tolist()
    named = [tuple(key) for key in keys]
    flat[0::4] = map(named.__getitem__, flat[0::4])
    return MemberRuns(tuple(flat))


def _member_runs(runs: list[Any]) -> MemberRuns:
    """A group's member runs listed (``[[key, split, first, length], ...]``, as states saved
    before 2026-12-08 hold them), checked.

    Raises:
        ValueError: a run is not such a value.
    """
    flat: list[Any] = []
    for run in runs:
        if not _member_run(run):
            raise ValueError(f"a group's member run must be [key, split, first, length], "
                             f"got {run!r:.80}")
        flat += (tuple(run[0]), run[1], run[2], run[3])
    return MemberRuns(tuple(flat))


def _member_run(run: Any) -> bool:
    """Whether ``run`` is one good member run (to name the first bad one)."""
    return (isinstance(run, list) and len(run) == 4 and is_pass_key(run[0])
            and all(natural(v) for v in run[1:]) and run[3] >= 1
            and run[1] <= INDEX_MASK and run[2] + run[3] <= INDEX_MASK + 1)


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


class Assigned(NamedTuple):
    """A split handed to a worker: ``pass_key`` names the pass it belongs to (a re-queued
    split may be read in a later pass), ``skip`` the indices already delivered, ``expect``
    the (count, digest) of an earlier reading when one is known, ``groups`` the groups
    anchored in it whose rows are to be made again (with the rows not to make). One per
    split read (short splits come by the thousand): a named tuple, the cheapest to make."""

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


def natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_pass_key(value: Any) -> bool:
    """Whether ``value`` is a pass key as JSON has it: a non-empty list of ints >= 0."""
    return (isinstance(value, list) and 0 < len(value) <= MAX_KEY_LENGTH
            and all(map(natural, value)))
