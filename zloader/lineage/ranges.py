"""Sets of indices as ranges: what a consumer holds of one split (:class:`Ranges`), and the
whole-array merges of many records' origins into them (:func:`merge_runs`,
:func:`merge_indices`), which the ledger (zloader/lineage/ledger.py) is built on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

import numpy as np

from zloader._defaults import (
    MERGE_COUNT_RUNS,
    MERGE_PLACES,
    MERGE_SPAN_FACTOR,
    MERGE_SPAN_SLACK,
    SMALL_INDEX_SET,
    SMALL_ORIGIN_BLOCK,
)
from zloader.lineage.tags import INDEX_BITS, INDEX_MASK

__all__ = ["Ranges", "code_runs", "index_runs", "merge_indices", "merge_runs"]


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


def index_runs(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The runs of consecutive indices that ``arrays`` hold (codes of one split reading,
    ``read << INDEX_BITS | index``, in any order, repeats allowed): their first indices
    and ends, sorted. The indices are sorted as 32-bit values (twice as quick as 64-bit
    ones): the codes' low 32 bits, which are the indices."""
    values = np.concatenate(arrays, dtype=np.uint32, casting="unsafe") if INDEX_BITS == 32 \
        else np.concatenate(arrays) & INDEX_MASK
    values.sort()
    cuts = np.flatnonzero(np.diff(values) > 1) + 1
    starts = values[np.concatenate(([0], cuts))].astype(np.int64)
    ends = values[np.concatenate((cuts - 1, [len(values) - 1]))].astype(np.int64) + 1
    return starts, ends


def merge_indices(starts: list[int], ends: list[int], arrays: list[np.ndarray]
                  ) -> tuple[list[int], list[int], int]:
    """The ranges ``starts``/``ends`` (sorted, disjoint, not touching: a :class:`Ranges`')
    with the indices of ``arrays`` added (int64 codes of one split reading, in any order,
    repeats allowed): the new starts and ends, and how many indices they hold. The lists
    given are left as they are. The compiled core's twin marks the indices in a bitmap
    instead of sorting them, and returns None where they spread too thin for one."""
    held = Ranges()
    held.starts, held.ends = list(starts), list(ends)
    arrays = [array for array in arrays if len(array)]
    if arrays:
        held.add(*index_runs(arrays))
    count = sum(held.ends) - sum(held.starts)  # (exact: Python ints)
    return held.starts, held.ends, count


def code_runs(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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

    # Adds many codes' indices at once (a shuffle's records): :func:`merge_indices`, or
    # its compiled twin, which zloader/client/exactly_once.py puts here (this layer is
    # below the compiled core's).
    merge: ClassVar[Callable[[list[int], list[int], list[np.ndarray]],
                             tuple[list[int], list[int], int] | None]] = \
        staticmethod(merge_indices)

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.count = 0

    @classmethod
    def of(cls, indices: Iterable[int]) -> Ranges:
        """The ranges of a set of indices."""
        ranges = cls()
        if isinstance(indices, range) and indices.step == 1:
            if indices:
                ranges.add_run(indices.start, indices.stop)
            return ranges
        if isinstance(indices, (set, frozenset, list)) and len(indices) <= SMALL_INDEX_SET:
            for index in sorted(set(indices)):  # (a group's rows: quicker than numpy)
                ranges.add_run(index, index + 1)
            return ranges
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
        first = np.flatnonzero(all_starts[1:] > reach[:-1]) + 1  # (and 0)
        merged_starts = np.concatenate((all_starts[:1], all_starts[first]))
        merged_ends = np.concatenate((reach[first - 1], reach[-1:]))
        self.starts, self.ends = merged_starts.tolist(), merged_ends.tolist()
        self.count = int((merged_ends - merged_starts).sum())

    def add_indices(self, arrays: list[np.ndarray]) -> None:
        """Add the indices of ``arrays`` (int64 codes of one split reading, any order)."""
        merged = Ranges.merge(self.starts, self.ends, arrays)
        if merged is None:  # (the compiled twin's: indices too thin for its bitmap)
            merged = merge_indices(self.starts, self.ends, arrays)
        self.starts, self.ends, self.count = merged

    def copy(self) -> Ranges:
        """The same set, on its own."""
        other = Ranges()
        other.starts, other.ends, other.count = list(self.starts), list(self.ends), self.count
        return other

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
