"""Elements handed on in bulk between the stages that take them so (a shuffle, a batch).

A stage's run yields elements one at a time; a stage with ``takes_chunks`` (zloader/stages.py)
gets :class:`Chunk` objects instead: consecutive elements' values in one list and, in an
exactly-once run, their origins beside them (an int64 array of codes as a split reading gives
them, or a list of origins), so that a tag costs a list entry rather than a tuple per element
and a batch gathers its rows' origins at numpy speed. ``compose`` puts :func:`gathered` and
:func:`flattened` between stages that differ; a read of the source may give chunks itself
(:data:`ChunkRead`).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from zloader._defaults import CHUNK_ELEMENTS, READ_AHEAD_SECONDS, SHUFFLE_DRAW_CHUNK
from zloader._seeding import Key
from zloader.lineage import gather, light, split_tags, take

__all__ = ["Chunk", "ChunkRead", "PooledOrigins", "RowOrigins", "ShuffleBuffer", "chunks_of",
           "flattened", "gathered", "picked"]

Run = Callable[[Key], Iterator[Any]]
ChunkRead = Callable[[Key, int], Iterator["Chunk"]]
"""A read of the source in chunks: given a pass key and the chunk size (0: growing, see
:func:`chunks_of`), the :class:`Chunk` objects of that pass."""


class Chunk(NamedTuple):
    """Consecutive elements handed on in bulk, between stages that take them so (a shuffle
    and a batch): their ``values`` and, in a tracked run, their ``origins`` (an int64 array
    of one code each, as a split reading gives them, or a list of the
    :data:`~zloader.lineage.Origin` each element held); None untracked. Never empty."""

    values: list[Any]
    origins: Any


def flattened(run: Run) -> Run:
    """The elements of a run of chunks, one at a time (tagged, in a tracked run)."""
    def elements(key: Key) -> Iterator[Any]:
        for values, origins in run(key):
            if origins is None:
                yield from values
            elif isinstance(origins, np.ndarray):  # (codes: each a 1-tuple origin, in C)
                yield from zip(values, zip(origins.tolist()), strict=True)
            else:
                yield from zip(values, origins, strict=True)
    return elements


def gathered(run: Run, tagged: bool, size: int) -> Run:
    """The elements of ``run`` in chunks (:func:`chunks_of`)."""
    def chunks(key: Key) -> Iterator[Chunk]:
        return chunks_of(run(key), tagged, size)
    return chunks


def chunks_of(elements: Iterator[Any], tagged: bool, size: int = 0) -> Iterator[Chunk]:
    """``elements`` (``(value, origin)`` pairs when ``tagged``) in chunks of ``size``; or
    (``size`` 0) in chunks which grow from one element to CHUNK_ELEMENTS while they are
    light (:func:`~zloader.lineage.light`) and come in under READ_AHEAD_SECONDS a chunk (a
    slow input's elements do not wait for each other, nor are heavy ones made ahead of
    their turn). Elements taken before ``elements`` raised are handed on first."""
    fixed = size > 0
    size = size if fixed else 1
    while True:
        started = time.perf_counter()
        group, failure = take(elements, size)
        chunk = Chunk(*split_tags(group)) if tagged else Chunk(group, None)
        if group:
            yield chunk
        if failure is not None:
            raise failure
        if len(group) < size:
            return
        if not fixed:
            quick = time.perf_counter() - started <= READ_AHEAD_SECONDS
            size = min(2 * size, CHUNK_ELEMENTS) if quick and light(chunk.values) else 1


class RowOrigins:
    """The origins of the elements a batch has taken and not yet used, in order: an int64
    array of one code each while chunks bring codes, a list of origins once one brings
    other origins (a batch of batches: many codes an element)."""

    __slots__ = ("codes", "listed")

    def __init__(self) -> None:
        self.codes = np.empty(0, np.int64)
        self.listed: list[Any] | None = None

    def add(self, origins: Any) -> None:
        if self.listed is None and isinstance(origins, np.ndarray):
            self.codes = np.concatenate((self.codes, origins)) if len(self.codes) else origins
            return
        if self.listed is None:
            self.listed = [(code,) for code in self.codes.tolist()]
        self.listed += ([(code,) for code in origins.tolist()]
                        if isinstance(origins, np.ndarray) else origins)

    def take(self, count: int) -> np.ndarray:
        """The codes of the next ``count`` elements' origins, as one new int64 array (all
        of them: the array held, handed over; a chunk's codes are its own, made for it)."""
        if self.listed is None:
            if count == len(self.codes):
                taken, self.codes = self.codes, np.empty(0, np.int64)
                return taken
            taken, self.codes = self.codes[:count].copy(), self.codes[count:]
            return taken
        taken_origins, self.listed = self.listed[:count], self.listed[count:]
        return gather(taken_origins)


def picked(items: list[Any], at: list[int]) -> list[Any]:
    """``[items[i] for i in at]`` at C speed (``at`` not empty)."""
    return list(operator.itemgetter(*at)(items)) if len(at) > 1 else [items[at[0]]]


class PooledOrigins:
    """The origins of a shuffle's pool, by number: an int64 array filled in place while
    they come as codes (a split's chunks, one code each), a list otherwise."""

    __slots__ = ("codes", "items", "size")

    def __init__(self) -> None:
        self.codes: np.ndarray | None = np.empty(0, np.int64)
        self.items: list[Any] = []
        self.size = 0

    def add(self, origins: Any) -> None:
        codes = self.codes
        if codes is not None and isinstance(origins, np.ndarray):
            end = self.size + len(origins)
            if end > len(codes):
                grown = np.empty(max(2 * end, CHUNK_ELEMENTS), np.int64)
                grown[:self.size] = codes[:self.size]
                self.codes = codes = grown
            codes[self.size:end] = origins
            self.size = end
            return
        if codes is not None:  # (origins of another form: every one kept as a list)
            self.items = [(code,) for code in codes[:self.size].tolist()]
            self.codes = None
        self.items += ([(code,) for code in origins.tolist()]
                       if isinstance(origins, np.ndarray) else origins)

    def pick(self, at: list[int]) -> Any:
        """The origins numbered ``at``, in order (an array, or a list)."""
        if self.codes is not None:  # (an index array first: faster than from the list)
            return self.codes[np.fromiter(at, np.intp, len(at))]
        return picked(self.items, at)

    def compact(self, held: list[int]) -> None:
        """Keep only the origins numbered ``held``, numbered anew from 0 in that order."""
        if self.codes is not None:
            self.codes[:len(held)] = self.codes[np.fromiter(held, np.intp, len(held))]
            self.size = len(held)
        else:
            self.items = picked(self.items, held)


class ShuffleBuffer:
    """A shuffle's buffer (zloader/stages.py ``Shuffle``), in pure Python; its compiled twin
    is ``zloader._core.ShuffleBuffer`` (zloader/_native.py picks one), which gives the same
    chunks for the same input and ``rng``.

    The buffer holds the numbers of the elements it holds in a pool of the values (and
    origins, ``track``) taken: :meth:`push` moves numbers, and each chunk's output values
    and origins are picked from the pool at C speed; the pool lets go of the values that
    left at once, and is compacted to what the buffer holds once it holds four times the
    buffer's size of places that left (at least a chunk's worth). Slots are drawn from
    ``rng`` SHUFFLE_DRAW_CHUNK at a time, in the order ``rng.integers`` gives them."""

    __slots__ = ("draws", "held", "origins", "pool", "rng", "size")

    def __init__(self, size: int, rng: np.random.Generator, track: bool) -> None:
        self.size, self.rng = size, rng
        self.pool: list[Any] = []  # values taken since the last compaction, by number
        self.origins = PooledOrigins() if track else None
        self.held: list[int] = []  # the buffer: numbers in pool of the elements it holds
        self.draws: list[int] = []  # slots drawn and not used yet, the next last

    def push(self, values: list[Any], origins: Any) -> Chunk | None:
        """Take a chunk in; the chunk of the elements it displaced (None while the buffer
        fills)."""
        pool, held, draws = self.pool, self.held, self.draws
        first = len(pool)
        pool += values
        if self.origins is not None:
            self.origins.add(origins)
        arrivals = range(first, len(pool))
        room = self.size - len(held)
        if room > 0:
            held += arrivals[:room]
            arrivals = arrivals[room:]
        out: list[int] = []
        for arrival in arrivals:
            if not draws:
                draws += self.rng.integers(0, self.size, SHUFFLE_DRAW_CHUNK).tolist()
                draws.reverse()
            slot = draws.pop()
            out.append(held[slot])
            held[slot] = arrival
        chunk = None
        if out:
            chunk = Chunk(picked(pool, out),
                          None if self.origins is None else self.origins.pick(out))
            for index in out:  # (what left is not kept alive until the compaction)
                pool[index] = None
        if len(pool) - len(held) >= max(4 * self.size, CHUNK_ELEMENTS):
            self.pool = picked(pool, held)
            if self.origins is not None:
                self.origins.compact(held)
            self.held = list(range(len(held)))
        return chunk

    def drain(self) -> Chunk | None:
        """The elements still held, in random order (None: none)."""
        if not self.held:
            return None
        out = picked(self.held, self.rng.permutation(len(self.held)).tolist())
        self.held = []
        return Chunk(picked(self.pool, out),
                     None if self.origins is None else self.origins.pick(out))
