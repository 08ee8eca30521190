"""Pipeline sources. Each divides its input into *splits*, the unit of work later handed to
workers: index ranges (``range``, ``from_items``, ``from_arrays``, ``from_torch``), one file
(``from_files``) or one user value (``from_generator``). The file-format sources
(TFRecord, WebDataset, Parquet, JSON lines, image folders) are in :mod:`zloader.formats`.

A source is a frozen record. ``split_order(key, entropy)`` says in which order its splits
are read for one pass (a seeded permutation when ``shuffle_splits=True``), ``read(split)``
yields the elements of one split, and ``identity()`` is what its fingerprint hashes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from zloader import _check
from zloader._defaults import DEFAULT_SPLITS
from zloader._seeding import Key, make_rng
from zloader.errors import PipelineError, passes_through
from zloader.runs import RunSettings, RunTally
from zloader.storage import FileRef
from zloader.storage import list_files as _storage_list_files

__all__ = [
    "ArraysSource",
    "FilesSource",
    "GeneratorSource",
    "ItemsSource",
    "PartsSource",
    "RangeSource",
    "Source",
    "TorchSource",
]


class ErrorPolicy(Protocol):
    """What a source sees of the run (its :class:`~zloader.runs.Context`): the run's
    :class:`~zloader.runs.RunSettings` (``skip_errors``: skip failures; ``epoch_input``,
    ``worker``, ``dispatched`` for adapters) and its :class:`~zloader.runs.RunTally`
    (``skipped``: the failures skipped)."""

    @property
    def settings(self) -> RunSettings: ...

    @property
    def tally(self) -> RunTally: ...


def guarded(make: Callable[[], Iterable[Any]], stage: str, where: Callable[[int], str],
            policy: ErrorPolicy | None = None) -> Iterator[Any]:
    """Iterate ``make()``, turning any exception from user code into a PipelineError (or,
    when ``policy`` skips errors, counting it and ending this iterable: a generator cannot
    go on after it raised). ``SystemExit`` and ``GeneratorExit`` from user code count as
    its failures too (see :func:`~zloader.errors.passes_through`); only the user code is
    guarded, not this generator's own ``yield`` (where ``close()`` throws GeneratorExit).
    ``where(index)`` names the element being read in the error."""
    try:
        iterator = iter(make())
    except BaseException as exc:
        _failed(exc, stage, where(0), policy)
        return
    for index in itertools.count():
        try:
            item = next(iterator)
        except StopIteration:
            return
        except BaseException as exc:
            _failed(exc, stage, where(index), policy)
            return
        yield item


def _failed(exc: BaseException, stage: str, context: str, policy: ErrorPolicy | None) -> None:
    """User code of a source raised ``exc``: count it when ``policy`` skips errors, else
    raise the stage's PipelineError (a main-thread KeyboardInterrupt propagates as it is)."""
    if passes_through(exc):
        raise exc
    if policy is not None and policy.settings.skip_errors:
        policy.tally.skipped += 1
        return
    raise PipelineError.from_exception(exc, stage, context) from exc


def split_order(num_splits: int, shuffle: bool, seed: int | None, entropy: int,
                key: Key) -> Sequence[int]:
    """The order in which a source with ``num_splits`` splits reads them in pass ``key``.

    A plain function of plain values, so the broker computes the same order as
    ``Pipeline.iter`` without loading the pipeline's code.
    """
    if not shuffle:
        return range(num_splits)
    order: list[int] = make_rng(seed, entropy, 0, key).permutation(num_splits).tolist()
    return order


def default_split_size(length: int) -> int:
    """Split size giving at most ``DEFAULT_SPLITS`` splits (at least one element each)."""
    return max(1, math.ceil(length / DEFAULT_SPLITS))


@dataclass(frozen=True, eq=False, kw_only=True)
class Source:
    """Base of all sources: split bookkeeping and the shared options."""

    kind: ClassVar[str] = "source"
    name: str
    shuffle_splits: bool
    seed: int | None
    version: str | None

    @property
    def num_splits(self) -> int:
        raise NotImplementedError

    def read(self, split: int, policy: ErrorPolicy | None = None) -> Iterator[Any]:
        """Yield the elements of split number ``split``; ``policy`` may skip failures."""
        raise NotImplementedError

    def identity(self) -> tuple[Any, ...]:
        """What the fingerprint hashes for this source."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    def locate(self, split: int, index: int) -> str:
        """Where element ``index`` of split ``split`` is in the input, for error messages
        (``"split 2, index 3"``; a file's path, a dataset's index where there is one)."""
        return f"split {split}, index {index}"

    @property
    def dispatched(self) -> bool:
        """Whether its workers make elements as the consumer dispatches work items during
        the epoch (``Loader.dispatch``, read through ``RunSettings.dispatched``); each element
        then goes out in a record of its own, as soon as it is made."""
        return False

    def forked(self, slot: int) -> bool | None:
        """Called in a worker forked for a Loader of this source, as it starts (before it
        connects to the broker): ``slot`` is the task index it will ask for
        (``READY.slot``; the broker gives it unless taken). A source may prepare there
        what that index's first epoch needs; it must not raise: it keeps an error for
        ``read`` to raise, and returns False (its Loader then waits for that error instead
        of going on; see ``Loader.prepared``). Nothing by default."""
        return None

    def innermost(self) -> Source:
        """The source whose data this one reads: itself, unless it wraps another (a
        cache over a source)."""
        return self

    def readers(self) -> list[Source]:
        """The sources whose data this one reads (a mix reads its inputs'), each its
        :meth:`innermost`: what a forked worker's packing looks into."""
        return [self.innermost()]

    def with_innermost(self, source: Source) -> Source:
        """This source reading ``source`` in place of :meth:`innermost` (the Loader takes
        a large in-memory source's data out, and a worker puts it back)."""
        return source

    def split_order(self, key: Key, entropy: int) -> Sequence[int]:
        """The splits of one pass, in reading order; ``key`` names the pass (epoch, repeats)."""
        return split_order(self.num_splits, self.shuffle_splits, self.seed, entropy, key)

    def splits_in(self, key: Key) -> int:
        """How many splits pass ``key`` reads: all of them (a mix's inputs differ)."""
        return self.num_splits

    def _options(self) -> tuple[Any, ...]:
        return (self.shuffle_splits, self.seed)


@dataclass(frozen=True, eq=False, kw_only=True)
class _IndexedSource(Source):
    """A source of ``length`` elements addressed by index, split into ranges."""

    length: int
    split_size: int

    @property
    def num_splits(self) -> int:
        return math.ceil(self.length / self.split_size)

    def split_range(self, split: int) -> tuple[int, int]:
        start = split * self.split_size
        return start, min(self.length, start + self.split_size)

    def read(self, split: int, policy: ErrorPolicy | None = None) -> Iterator[Any]:
        start, stop = self.split_range(split)
        return self._rows(start, stop, policy)

    def locate(self, split: int, index: int) -> str:
        start = self.split_range(split)[0]
        return f"split {split}, index {index} (element {start + index} of {self.name})"

    def _rows(self, start: int, stop: int, policy: ErrorPolicy | None) -> Iterator[Any]:
        raise NotImplementedError

    def _options(self) -> tuple[Any, ...]:
        return (self.length, self.split_size, self.shuffle_splits, self.seed)


@dataclass(frozen=True, eq=False, kw_only=True)
class RangeSource(_IndexedSource):
    """``Pipeline.range``: integers from ``start`` by ``step``."""

    kind: ClassVar[str] = "range"
    start: int
    step: int

    def _rows(self, start: int, stop: int, policy: ErrorPolicy | None) -> Iterator[int]:
        first = self.start + start * self.step
        return iter(range(first, first + (stop - start) * self.step, self.step))

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.version, self.start, self.step, *self._options())

    def describe(self) -> str:
        stop = self.start + self.length * self.step
        return f"range({self.start}, {stop}, {self.step})"


@dataclass(frozen=True, eq=False, kw_only=True)
class ItemsSource(_IndexedSource):
    """``Pipeline.from_items``: the items of a sequence."""

    kind: ClassVar[str] = "from_items"
    items: tuple[Any, ...]

    def _rows(self, start: int, stop: int, policy: ErrorPolicy | None) -> Iterator[Any]:
        return iter(self.items[start:stop])

    def identity(self) -> tuple[Any, ...]:
        content = self.items if self.version is None else None
        return (self.kind, self.version, content, *self._options())


@dataclass(frozen=True, eq=False, kw_only=True)
class ArraysSource(_IndexedSource):
    """``Pipeline.from_arrays``: the rows of arrays (a structure of them)."""

    kind: ClassVar[str] = "from_arrays"
    structure: Any

    def _rows(self, start: int, stop: int, policy: ErrorPolicy | None) -> Iterator[Any]:
        for index in range(start, stop):
            yield _row(self.structure, index)

    def identity(self) -> tuple[Any, ...]:
        content = self.structure if self.version is None else _shapes(self.structure)
        return (self.kind, self.version, content, *self._options())


@dataclass(frozen=True, eq=False, kw_only=True)
class TorchSource(_IndexedSource):
    """``Pipeline.from_torch``: a map-style torch dataset's items."""

    kind: ClassVar[str] = "from_torch"
    dataset: Any

    def _rows(self, start: int, stop: int, policy: ErrorPolicy | None) -> Iterator[Any]:
        dataset = self.dataset
        for index in range(start, stop):
            try:
                item = dataset[index]
            except BaseException as exc:
                if passes_through(exc):
                    raise
                if policy is not None and policy.settings.skip_errors:
                    policy.tally.skipped += 1
                    continue
                raise PipelineError.from_exception(exc, self.name,
                                                   f"dataset index {index}") from exc
            yield item

    def locate(self, split: int, index: int) -> str:
        start = self.split_range(split)[0]
        return f"dataset index {start + index} (split {split}, index {index})"

    def identity(self) -> tuple[Any, ...]:
        content = self.dataset if self.version is None else None
        return (self.kind, self.version, content, *self._options())


@dataclass(frozen=True, eq=False, kw_only=True)
class FilesSource(Source):
    """One split per file; ``files`` holds (absolute path or URL, size, version tag) taken
    at creation (see :data:`zloader.storage.FileRef`)."""

    kind: ClassVar[str] = "from_files"
    files: tuple[FileRef, ...]
    reader: Callable[[str], Iterable[Any]]

    @property
    def num_splits(self) -> int:
        return len(self.files)

    def read(self, split: int, policy: ErrorPolicy | None = None) -> Iterator[Any]:
        path = self.files[split][0]
        return guarded(lambda: self.reader(path), self.name,
                       lambda index: self.locate(split, index), policy)

    def locate(self, split: int, index: int) -> str:
        return f"file {self.files[split][0]}, index {index} (split {split})"

    def identity(self) -> tuple[Any, ...]:
        if self.version is None:
            return (self.kind, None, self.files, self.reader, *self._options())
        return (self.kind, self.version, [f[0] for f in self.files], *self._options())


@dataclass(frozen=True, eq=False, kw_only=True)
class GeneratorSource(Source):
    """``Pipeline.from_generator``: what ``fn`` yields for each of ``splits``."""

    kind: ClassVar[str] = "from_generator"
    fn: Callable[[Any], Iterable[Any]]
    splits: tuple[Any, ...]

    @property
    def num_splits(self) -> int:
        return len(self.splits)

    def read(self, split: int, policy: ErrorPolicy | None = None) -> Iterator[Any]:
        value = self.splits[split]
        return guarded(lambda: self.fn(value), self.name,
                       lambda index: self.locate(split, index), policy)

    def locate(self, split: int, index: int) -> str:
        return f"split {self.splits[split]!r:.80}, index {index} (split number {split})"

    def identity(self) -> tuple[Any, ...]:
        fn = self.fn if self.version is None else None
        return (self.kind, self.version, fn, self.splits, *self._options())


@dataclass(frozen=True, eq=False, kw_only=True)
class PartsSource(Source):
    """``source`` read in ``parts`` interleaved parts of each of its splits: split
    ``s * parts + j`` is elements ``j, j + parts, j + 2 * parts, ...`` of ``source``'s
    split ``s``. Each part reads the whole split and keeps its share, so ``source`` is
    read ``parts`` times: how a mix its workers draw spreads an input of few splits that
    cannot be cut by index (files, a generator) over its workers (zloader/plan.py
    ``spread``). An element skipped by ``on_error="skip"`` in the source's own reading
    counts once per part."""

    kind: ClassVar[str] = "parts"
    source: Source
    parts: int

    @property
    def num_splits(self) -> int:
        return self.source.num_splits * self.parts

    def read(self, split: int, policy: ErrorPolicy | None = None) -> Iterator[Any]:
        whole, part = divmod(split, self.parts)
        return itertools.islice(self.source.read(whole, policy), part, None, self.parts)

    def locate(self, split: int, index: int) -> str:
        whole, part = divmod(split, self.parts)
        return self.source.locate(whole, part + index * self.parts)

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.parts, self.source.kind, self.source.identity())

    def describe(self) -> str:
        return f"{self.source.describe()} (in {self.parts} parts)"

    def forked(self, slot: int) -> bool | None:
        return self.source.forked(slot)

    def innermost(self) -> Source:
        return self.source.innermost()

    def with_innermost(self, source: Source) -> Source:
        return dataclasses.replace(self, source=self.source.with_innermost(source))


def in_parts(source: Source, parts: int) -> PartsSource:
    """``source`` read in ``parts`` interleaved parts of each split (:class:`PartsSource`),
    its splits shuffled (or not) as ``source`` shuffles its own."""
    return PartsSource(name=source.name, shuffle_splits=source.shuffle_splits,
                       seed=source.seed, version=source.version, source=source, parts=parts)


# --- helpers for the Pipeline constructors -----------------------------------------------

def resolve_split_size(split_size: Any, length: int) -> int:
    if split_size is None:
        return default_split_size(length)
    return _check.integer("split_size", split_size, 1)


def check_arrays(structure: Any) -> tuple[Any, int]:
    """Validate a ``from_arrays`` structure; return it with read-only arrays, and its length."""
    lengths: list[tuple[str, int]] = []

    def visit(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            if not node:
                raise ValueError(f"from_arrays: {path} is an empty dict")
            return {k: visit(v, f"{path}[{k!r}]") for k, v in node.items()}
        if isinstance(node, tuple):
            if not node:
                raise ValueError(f"from_arrays: {path} is an empty tuple")
            return tuple(visit(v, f"{path}[{i}]") for i, v in enumerate(node))
        array = np.asarray(node)
        if array.ndim == 0:
            raise ValueError(f"from_arrays: {path} is a scalar, not an array of rows")
        if array.dtype.hasobject:
            raise TypeError(f"from_arrays: {path} has dtype object; give arrays of numbers, "
                            "or use from_items")
        view = array.view()
        view.flags.writeable = False  # rows reach user code; they must not alter the source
        lengths.append((path, len(view)))
        return view

    checked = visit(structure, "structure")
    first_path, length = lengths[0]
    for path, size in lengths:
        if size != length:
            raise ValueError(f"from_arrays: {path} has {size} rows but {first_path} has "
                             f"{length}; every array must have the same length")
    return checked, length


def list_files(paths_or_glob: Any, storage_options: dict[str, Any] | None = None
               ) -> tuple[FileRef, ...]:
    """Expand a glob pattern or check a list of paths or URLs; stat each file (see
    :func:`zloader.storage.list_files`)."""
    return _storage_list_files(paths_or_glob, storage_options, "from_files")


def _row(structure: Any, index: int) -> Any:
    if isinstance(structure, dict):
        return {k: _row(v, index) for k, v in structure.items()}
    if isinstance(structure, tuple):
        return tuple(_row(v, index) for v in structure)
    return structure[index]


def _shapes(structure: Any) -> Any:
    if isinstance(structure, dict):
        return {k: _shapes(v) for k, v in structure.items()}
    if isinstance(structure, tuple):
        return tuple(_shapes(v) for v in structure)
    return (structure.dtype.str, structure.shape)
