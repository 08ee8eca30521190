"""Origins on the wire: the block a record carries after its codec buffers (written by
the worker, :func:`encode_origins`; read by the consumer, :func:`decode_origins`).
"""

from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from zloader._defaults import (
    MAX_GROUP_MEMBERS,
    SCATTER_SAMPLE,
    SMALL_ORIGIN_BLOCK,
)
from zloader.lineage.tags import (
    INDEX_BITS,
    INDEX_MASK,
    MAX_KEY_LENGTH,
    MAX_PASS_ID,
    MAX_READ,
    Group,
    Key,
    MemberRuns,
    Origin,
    gather,
)

__all__ = ["Origins", "decode_origins", "encode_origins", "runs_of_list"]


if TYPE_CHECKING:
    from zloader.lineage.ledger import Ledger

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
    from the oldest of them to the producer's latest when they are few, at most twice as
    many as the codes (one numpy call, not a sort: a record of short splits' elements
    holds as many readings as elements)."""
    low, high = int(np.minimum.reduce(codes)) >> INDEX_BITS, len(reads) - 1
    used = (range(low, high + 1) if high - low < max(64, 2 * len(codes))
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
        if self.groups:  # (their elements are held before any of their rows)
            ledger.define_groups(self.groups)
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
        if self.groups:
            ledger.define_groups(self.groups)
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
        runs: list[Any] = values[at + 6:at + 6 + 4 * nruns]
        at += 6 + 4 * nruns
        if pass_id not in keys or not (0 <= split <= INDEX_MASK and 0 <= index <= INDEX_MASK
                                       and position >= 1 and rows >= 1 and nruns >= 1) \
                or len(runs) != 4 * nruns:
            raise ValueError("a block's group must be (pass, split, index, position >= 1, "
                             "rows >= 1, runs >= 1) of a pass the block names")
        passes, splits, firsts, lengths = runs[0::4], runs[1::4], runs[2::4], runs[3::4]
        if not (set(passes) <= keys.keys() and min(splits) >= 0 and max(splits) <= INDEX_MASK
                and min(firsts) >= 0 and min(lengths) >= 1
                and max(map(operator.add, firsts, lengths)) <= INDEX_MASK + 1):
            raise ValueError("a block's group member run names a pass the block does "
                             "not, or indices outside [0, 2**32)")
        runs[0::4] = map(keys.__getitem__, passes)
        if sum(lengths) > MAX_GROUP_MEMBERS or runs[:3] != [keys[pass_id], split, index]:
            raise ValueError("a block's group must start with its anchor and hold at most "
                             f"{MAX_GROUP_MEMBERS} elements")
        groups.append(Group(keys[pass_id], split, index, position, rows,
                            MemberRuns(tuple(runs))))
    return groups


_NO_RUNS = np.empty((0, 4), np.int64)
_NO_RUNS.flags.writeable = False


def _check_codes(table: list[int], codes: np.ndarray, keys: dict[int, Key]) -> None:
    """Check a block's codes against its table of reads (read, pass id, split, flat):
    distinct reads below 2**31 of known passes and splits, and each code of a read the
    table names."""
    _check_reads(table, keys)
    if len(codes):
        _check_code_reads(table[0::3], codes, int(np.minimum.reduce(codes)),
                          int(np.maximum.reduce(codes)))


def _check_reads(table: list[int], keys: dict[int, Key]) -> None:
    """Check a block's table of reads (read, pass id, split, flat): distinct reads below
    2**31 of known passes and splits."""
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


def _check_code_reads(ids: list[int], codes: np.ndarray, low: int, high: int) -> None:
    """Check that each of ``codes`` (not empty; ``low`` and ``high`` the least and the
    greatest) is of a read that ``ids`` names."""
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
            or int(runs[:, 1].max()) > INDEX_MASK or int(runs[:, 2].max()) > INDEX_MASK \
            or int(runs[:, 3].max()) > INDEX_MASK + 1 \
            or int((runs[:, 2] + runs[:, 3]).max()) > INDEX_MASK + 1:  # (no wrap: both bounded)
        raise ValueError("an origin run names a pass the block does not, or indices "
                         "outside [0, 2**32)")
    return int(runs[:, 3].sum())
