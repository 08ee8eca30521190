"""Pipeline stages: frozen records that know how to transform a stream of elements.

A stage's ``wrap(upstream, position, ctx)`` takes the *run* of everything before it
(a function from a pass key to an iterator of elements) and returns its own run. Most
stages transform one iterator; ``repeat`` re-runs its upstream with a longer pass key, so
that stages above it (a shuffle, the source's split order) draw fresh randomness on every
repetition, while stages below see one pass.

Exceptions from user functions leave a stage as :class:`~zloader.errors.PipelineError`
naming the stage; errors in the data a stage receives (``batch`` of unequal shapes) do too.
That includes ``SystemExit`` and ``GeneratorExit`` (which would otherwise end a worker's
producer thread without a word), and a ``KeyboardInterrupt`` raised on any thread but the
main one; on the main thread a ``KeyboardInterrupt`` may be Ctrl-C and propagates as it is
(:func:`~zloader.errors.passes_through`).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from zloader import _native, collate, groups
from zloader._seeding import Key
from zloader.chunks import (
    ChunkRead,
    RowOrigins,
    ShuffleBuffer,
    flattened,
    gathered,
)
from zloader.errors import PipelineError, passes_through
from zloader.runs import Context

if TYPE_CHECKING:
    from concurrent.futures import Future

__all__ = ["Batch", "BucketByLength", "Filter", "Map", "Repeat", "Run",
           "Shuffle", "Skip", "Stage", "Take", "Unbatch", "compose"]

Run = Callable[[Key], Iterator[Any]]

shuffle_buffer = _native.pick("ShuffleBuffer", ShuffleBuffer)
"""A shuffle's buffer: compiled where built (zloader/_native.py)."""


def compose(read: Run, stages: tuple[Stage, ...], ctx: Context, first_position: int = 1,
            read_chunks: ChunkRead | None = None, after_mix: bool = False) -> Run:
    """Chain ``stages`` on top of the ``read`` run; positions count from ``first_position``.
    ``read_chunks``: the same elements as :class:`Chunk` objects, read so when the first
    stage takes chunks. ``after_mix``: ``stages`` follow a mix (a group's elements first
    run their input's stages when made again). Between a stage that gives chunks and one
    that takes elements (and back) the elements are handed on one at a time (and
    gathered again). Sets
    ``ctx.aligned``: ``first_position + len(stages)`` when the last stage's output still
    comes in the source's order."""
    run, chunked = read, False
    if read_chunks is not None and stages and stages[0].takes_chunks:
        size = stages[0].chunk_size
        run, chunked = (lambda key: read_chunks(key, size)), True
    ctx.aligned = first_position + len(stages)
    if ctx.settings.track:
        ctx.note_sections(stages, first_position, after_mix)
    for position, stage in enumerate(stages, first_position):
        if stage.takes_chunks and not chunked:
            run = gathered(run, ctx.settings.track, stage.chunk_size)
        elif chunked and not stage.takes_chunks:
            run = flattened(run)
        run = stage.wrap(run, position, ctx)
        chunked = stage.gives_chunks
        if not stage.keeps_order:
            ctx.aligned = min(ctx.aligned, position)
    return flattened(run) if chunked else run


@dataclass(frozen=True, eq=False, kw_only=True)
class Stage:
    """Base of all stages. ``name`` is shown in errors and stats; ``version`` pins identity."""

    kind: ClassVar[str] = "stage"
    takes_chunks: ClassVar[bool] = False
    """Its ``transform`` takes :class:`Chunk` objects, not elements one at a time."""
    gives_chunks: ClassVar[bool] = False
    """Its ``transform`` yields :class:`Chunk` objects."""
    name: str
    version: str | None = None

    @property
    def chunk_size(self) -> int:
        """For a stage that takes chunks, the size of those gathered for it from elements
        that come one at a time; 0: as many as come quickly (:func:`chunks_of`)."""
        return 0

    @property
    def keeps_order(self) -> bool:
        """Whether this stage passes elements on in the order it takes them, each as soon
        as it took it (a map, a filter), so the source's position names them."""
        return False

    def wrap(self, upstream: Run, position: int, ctx: Context) -> Run:
        """Return the run of this stage on top of ``upstream``."""
        def run(key: Key) -> Iterator[Any]:
            return self.transform(upstream(key), key, position, ctx)
        return run

    def transform(self, elements: Iterator[Any], key: Key, position: int,
                  ctx: Context) -> Iterator[Any]:
        raise NotImplementedError

    def identity(self) -> tuple[Any, ...]:
        """What the fingerprint hashes for this stage (never its name)."""
        raise NotImplementedError

    def _fails(self, exc: BaseException, where: str = "") -> PipelineError:
        return PipelineError.from_exception(exc, self.name, where)

    def _user_failed(self, exc: BaseException, element: Any, ctx: Context, position: int,
                     at: tuple[int, int] | None = None, here: bool = True) -> None:
        """User code raised ``exc`` on ``element``: count and drop the element when the run
        skips errors, else raise the stage's PipelineError naming where the element came
        from (``at``: see :meth:`Context.where`). ``here``: the code ran in this thread (a
        main-thread KeyboardInterrupt, maybe Ctrl-C, then propagates as it is)."""
        if here and passes_through(exc):
            raise exc
        if ctx.settings.skip_errors:
            ctx.tally.skipped += 1
            ctx.drop(element)
            return
        raise self._fails(exc, ctx.where(element, position, at)) from exc


@dataclass(frozen=True, eq=False, kw_only=True)
class Map(Stage):
    """``Pipeline.map``: ``fn`` applied to each element (on ``num_parallel_calls`` threads)."""

    kind: ClassVar[str] = "map"
    fn: Callable[[Any], Any]
    num_parallel_calls: int = 1

    @property
    def keeps_order(self) -> bool:
        return self.num_parallel_calls == 1  # the pool reads ahead of what it yields

    def transform(self, elements: Iterator[Any], key: Key, position: int,
                  ctx: Context) -> Iterator[Any]:
        if self.num_parallel_calls > 1:
            yield from self._parallel(elements, position, ctx)
            return
        fn = ctx.values(self.fn)
        for element in elements:
            try:
                result = fn(element)
            except BaseException as exc:  # SystemExit too: it must not end a worker's thread
                self._user_failed(exc, element, ctx, position)
                continue
            yield result

    def _parallel(self, elements: Iterator[Any], position: int,
                  ctx: Context) -> Iterator[Any]:
        """Up to ``num_parallel_calls`` calls in flight on threads; results in input order."""
        from concurrent.futures import ThreadPoolExecutor  # (only such a map needs it)
        pending: deque[tuple[Future[Any], Any, tuple[int, int] | None]] = deque()
        fn = ctx.values(self.fn)
        with ThreadPoolExecutor(self.num_parallel_calls,
                                thread_name_prefix=f"zloader {self.name}") as pool:
            try:
                for element in elements:
                    pending.append((pool.submit(fn, element), element, ctx.at))
                    if len(pending) >= self.num_parallel_calls:
                        yield from self._result(*pending.popleft(), position, ctx)
                while pending:
                    yield from self._result(*pending.popleft(), position, ctx)
            finally:
                for future, _, _ in pending:
                    future.cancel()

    def _result(self, future: Future[Any], element: Any, at: tuple[int, int] | None,
                position: int, ctx: Context) -> Iterator[Any]:
        try:
            result = future.result()
        except BaseException as exc:  # raised on a pool thread: never this thread's Ctrl-C
            self._user_failed(exc, element, ctx, position, at, here=False)
            return
        yield result

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.version, self.fn if self.version is None else None)


@dataclass(frozen=True, eq=False, kw_only=True)
class Filter(Stage):
    """``Pipeline.filter``: the elements ``predicate`` keeps."""

    kind: ClassVar[str] = "filter"
    predicate: Callable[[Any], Any]

    @property
    def keeps_order(self) -> bool:
        return True

    def transform(self, elements: Iterator[Any], key: Key, position: int,
                  ctx: Context) -> Iterator[Any]:
        predicate = self.predicate
        if ctx.settings.track:
            predicate = lambda tagged: self.predicate(tagged[0])
        for element in elements:
            try:
                keep = bool(predicate(element))
            except BaseException as exc:
                self._user_failed(exc, element, ctx, position)
                continue
            if keep:
                yield element
            else:
                ctx.drop(element)

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.version, self.predicate if self.version is None else None)


@dataclass(frozen=True, eq=False, kw_only=True)
class Shuffle(Stage):
    """tf.data's buffered shuffle: fill ``buffer_size``, then emit a random buffered element
    and put the next input in its place; at the end, emit what remains in random order.

    It works in chunks, through a :class:`~zloader.chunks.ShuffleBuffer` (compiled where
    the compiled core is built: zloader/_native.py), which moves the numbers of the
    elements it holds and picks each chunk's values and origins at C speed."""

    kind: ClassVar[str] = "shuffle"
    takes_chunks: ClassVar[bool] = True
    gives_chunks: ClassVar[bool] = True
    buffer_size: int
    seed: int | None = None
    reshuffle_each_epoch: bool = True

    def transform(self, elements: Iterator[Any], key: Key, position: int,
                  ctx: Context) -> Iterator[Any]:
        rng = ctx.rng(self.seed, position, key if self.reshuffle_each_epoch else ())
        buffer = shuffle_buffer(self.buffer_size, rng, ctx.settings.track)
        for values, origins in elements:
            chunk = buffer.push(values, origins)
            if chunk is not None:
                yield chunk
                del chunk
        rest = buffer.drain()
        if rest is not None:
            yield rest

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.version, self.buffer_size, self.seed, self.reshuffle_each_epoch)


@dataclass(frozen=True, eq=False, kw_only=True)
class Batch(Stage):
    """Batches of ``batch_size`` consecutive elements (the last smaller unless
    ``drop_remainder``), stacked by :func:`zloader.collate.stack`; a tracked batch holds
    its rows' origins as one int64 array (:func:`~zloader.lineage.gather`)."""

    kind: ClassVar[str] = "batch"
    takes_chunks: ClassVar[bool] = True
    batch_size: int
    drop_remainder: bool = False

    @property
    def chunk_size(self) -> int:
        return self.batch_size  # (it takes no more than a batch needs)

    def transform(self, elements: Iterator[Any], key: Key, position: int,
                  ctx: Context) -> Iterator[Any]:
        size = self.batch_size
        later = position == ctx.records_from  # (large arrays stacked by the record's copy)
        values: list[Any] = []
        origins = RowOrigins() if ctx.settings.track else None  # those of ``values``
        for chunk_values, chunk_origins in elements:
            values += chunk_values
            if origins is not None:
                origins.add(chunk_origins)
            while len(values) >= size:
                codes = None if origins is None else origins.take(size)
                yield self._stack(values[:size], codes, later)
                del values[:size]
        if values and not self.drop_remainder:
            codes = None if origins is None else origins.take(len(values))
            yield self._stack(values, codes, later)
        elif origins is not None:
            ctx.drop_chunk(origins.take(len(values)))

    def _stack(self, values: list[Any], codes: np.ndarray | None, later: bool) -> Any:
        try:
            batch = collate.stack(values, later=later)
        except (TypeError, ValueError) as exc:
            raise self._fails(exc) from exc
        return batch if codes is None else (batch, codes)

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.version, self.batch_size, self.drop_remainder)


@dataclass(frozen=True, eq=False, kw_only=True)
class BucketByLength(Stage):
    """Batches of elements of similar length: bucket ``i`` holds lengths in
    ``[boundaries[i-1], boundaries[i])`` (the first from 0, the last without end) and emits
    a batch, padded to its longest element, each time it holds ``batch_sizes[i]`` elements.
    In a coordinated job (``ctx.settings.round_size`` N > 1) a bucket waits for N batches and emits
    them together, so one round's batches share a bucket; what is left at the end, fewer
    than N batches, is dropped and counted in ``ctx.tally.dropped``. Otherwise the end flushes
    each bucket in order (its last batch is smaller unless ``drop_remainder``)."""

    kind: ClassVar[str] = "bucket_by_length"
    length_fn: Callable[[Any], Any]
    boundaries: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    pad_value: Any = 0
    drop_remainder: bool = False

    def transform(self, elements: Iterator[Any], key: Key, position: int,
                  ctx: Context) -> Iterator[Any]:
        group = max(1, ctx.settings.round_size)
        buckets: list[list[Any]] = [[] for _ in self.batch_sizes]
        for element in elements:
            try:
                length = self._length(ctx.value(element))
            except BaseException as exc:
                self._user_failed(exc, element, ctx, position)
                continue
            index = bisect.bisect_right(self.boundaries, length)
            bucket = buckets[index]
            bucket.append(element)
            if len(bucket) == self.batch_sizes[index] * group:
                yield from self._batches(bucket, self.batch_sizes[index], ctx)
                buckets[index] = []
        for index, bucket in enumerate(buckets):
            size = self.batch_sizes[index]
            count = len(bucket) // size if self.drop_remainder else -(-len(bucket) // size)
            if group == 1:
                yield from self._batches(bucket[:count * size], size, ctx)
                for element in bucket[count * size:]:
                    ctx.drop(element)
            else:
                ctx.tally.dropped += count  # fewer than a round's worth: dropped whole

    def _length(self, element: Any) -> int:
        length = self.length_fn(element)
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) \
                or length < 0:
            raise TypeError(f"length_fn must return an int >= 0, got {length!r}")
        return int(length)

    def _batches(self, bucket: list[Any], size: int, ctx: Context) -> Iterator[Any]:
        for start in range(0, len(bucket), size):
            try:
                batch = ctx.stack(bucket[start:start + size], self.pad_value)
            except (TypeError, ValueError) as exc:
                raise self._fails(exc) from exc
            yield batch

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.version, self.length_fn if self.version is None else None,
                self.boundaries, self.batch_sizes, self.pad_value, self.drop_remainder)


@dataclass(frozen=True, eq=False, kw_only=True)
class Unbatch(Stage):
    """``Pipeline.unbatch``: each batch's rows, one element each."""

    kind: ClassVar[str] = "unbatch"

    def transform(self, elements: Iterator[Any], key: Key, position: int,
                  ctx: Context) -> Iterator[Any]:
        for element in elements:
            if ctx.rebuilds:  # (rows lost with a worker, made again here)
                yield from groups.rebuilt(ctx, self, position, key)
            try:
                rows = list(collate.split(ctx.value(element)))
            except (TypeError, ValueError) as exc:
                raise self._fails(exc) from exc
            if not ctx.settings.track:
                yield from rows
                continue
            origin = element[1]
            if groups.kept(ctx.sections.get((id(self), position)), origin, len(rows)):
                for at, row in enumerate(rows):
                    yield (row, origin[at:at + 1])
            elif rows:  # rows that are not the batch's elements: a group of them
                yield from groups.tag(ctx, self, rows, origin, position)
            else:
                ctx.drop(element)
        if ctx.rebuilds:
            yield from groups.rebuilt(ctx, self, position, key)

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.version)


@dataclass(frozen=True, eq=False, kw_only=True)
class Repeat(Stage):
    """Repeats its upstream ``count`` times (forever when None). An endless repeat ends
    when its input turns out empty, so ``repeat()`` on empty input ends instead of
    spinning: a repetition that yields nothing, in one process; on a worker, repetitions
    that yield nothing though they read every split (:class:`Coverage`)."""

    kind: ClassVar[str] = "repeat"
    count: int | None = None

    @property
    def keeps_order(self) -> bool:
        return True

    def wrap(self, upstream: Run, position: int, ctx: Context) -> Run:
        count = self.count

        def run(key: Key) -> Iterator[Any]:
            empty: set[int] = set()  # splits read afresh since the last element
            for repetition in itertools.count() if count is None else range(count):
                produced = False
                sub = (*key, repetition)
                for element in upstream(sub):
                    produced = True
                    yield element
                if ctx.coverage is not None and ctx.coverage.ended(key):
                    return  # (the run ended this pass early: a mix stopped, no more splits)
                if ctx.coverage is not None and (produced or count is not None):
                    ctx.coverage.close(sub)
                    empty.clear()
                elif count is None and not produced and ctx.input_empty(sub, empty):
                    return
        return run

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.version, self.count)


@dataclass(frozen=True, eq=False, kw_only=True)
class Take(Stage):
    """``Pipeline.take``: the first ``count`` elements."""

    kind: ClassVar[str] = "take"
    count: int

    @property
    def keeps_order(self) -> bool:
        return True

    def transform(self, elements: Iterator[Any], key: Key, position: int,
                  ctx: Context) -> Iterator[Any]:
        if self.count == 0:
            return
        for taken, element in enumerate(elements, 1):
            yield element
            if taken >= self.count:
                return

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.version, self.count)


@dataclass(frozen=True, eq=False, kw_only=True)
class Skip(Stage):
    """``Pipeline.skip``: all but the first ``count`` elements."""

    kind: ClassVar[str] = "skip"
    count: int

    @property
    def keeps_order(self) -> bool:
        return True

    def transform(self, elements: Iterator[Any], key: Key, position: int,
                  ctx: Context) -> Iterator[Any]:
        for skipped, element in enumerate(elements):
            if skipped >= self.count:
                yield element

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.version, self.count)
