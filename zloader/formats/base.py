"""What the file-format sources share: their files, their units, and parallel reads.

A format source reads *units*, its natural pieces of input (a file, a tar shard, a Parquet
row group, a chunk of image files). With ``parallel_reads=1`` each unit is one split. With
``parallel_reads=k`` a split is ``k`` consecutive units, read at once by ``k`` threads of
the worker and interleaved one element at a time, as tf.data's ``interleave`` with
``cycle_length=k``: storage whose latency, not bandwidth, bounds a read then needs k times
fewer processes. ``deterministic=True`` takes the units' elements in turn (the same order
on every run); ``deterministic=False`` takes whichever element is ready first.

A reader that meets an element it cannot read (a corrupt record, a line that is not JSON,
an image that does not decode) yields a :class:`Bad` in its place and goes on with the
next element: the source raises it, or under ``on_error="skip"`` counts and drops that
element only. A failure that leaves the rest of a unit unreadable (a truncated file, a
broken tar) is raised by the reader and ends the unit.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from zloader._defaults import PARALLEL_READ_BUFFER, PARALLEL_READ_POLL
from zloader.errors import PipelineError
from zloader.runs import RunSettings, RunTally
from zloader.sources import ErrorPolicy, Source, guarded
from zloader.storage import FileRef, open_file

__all__ = ["Bad", "FormatSource", "interleave"]


@dataclass(frozen=True)
class Bad:
    """An element a reader could not read, yielded in its place.

    Attributes:
        error: what is wrong; its message names the file and the place in it.
        where: the element's place (``"file a.jsonl, line 5"``), the error's context.
    """

    error: Exception
    where: str


@dataclass
class _Counter:
    """The error policy of one reader thread (the run's settings, a tally of its own): its
    skips are added to the run's at the end."""

    settings: RunSettings
    tally: RunTally = field(default_factory=RunTally)


@dataclass(frozen=True, eq=False, kw_only=True)
class FormatSource(Source):
    """Base of the format sources: ``files`` (with size and version tag, taken when the
    pipeline was built), ``storage_options`` for fsspec, and parallel reads.

    Subclasses define :attr:`units`, :meth:`unit_name` and :meth:`read_unit`.
    """

    files: tuple[FileRef, ...]
    storage_options: dict[str, Any] | None
    parallel_reads: int
    deterministic: bool

    @property
    def units(self) -> Sequence[Any]:
        """The units, in order; a file index by default."""
        return range(len(self.files))

    def unit_name(self, unit: Any) -> str:
        """The unit in an error message (its file, and its place in the file)."""
        return f"file {self.files[unit][0]}"

    def open(self, file: int) -> BinaryIO:
        """Open file number ``file`` for streaming reads."""
        path, size, _ = self.files[file]
        return open_file(path, self.storage_options, size)

    def read_unit(self, unit: Any) -> Iterator[Any]:
        """Yield the elements of one unit, and a :class:`Bad` in place of each element that
        cannot be read; raise what leaves the rest of the unit unreadable."""
        raise NotImplementedError

    @property
    def num_splits(self) -> int:
        return math.ceil(len(self.units) / self.parallel_reads)

    def split_units(self, split: int) -> Sequence[Any]:
        units = self.units
        return units[split * self.parallel_reads:(split + 1) * self.parallel_reads]

    def read(self, split: int, policy: ErrorPolicy | None = None) -> Iterator[Any]:
        units = self.split_units(split)
        if len(units) == 1:
            return self._guarded(units[0], policy)
        settings = policy.settings if policy is not None else RunSettings(entropy=0)
        counters = [_Counter(settings) for _ in units]
        readers = [functools.partial(self._guarded, unit, counter)
                   for unit, counter in zip(units, counters, strict=True)]
        return _counted(interleave(readers, self.deterministic), counters, policy)

    def _guarded(self, unit: Any, policy: ErrorPolicy | None) -> Iterator[Any]:
        name = self.unit_name(unit)
        elements = guarded(lambda: self.read_unit(unit), self.name,
                           lambda index: f"{name}, element {index}", policy)
        return _without_bad(elements, self.name, policy)

    def locate(self, split: int, index: int) -> str:
        names = ", ".join(self.unit_name(u) for u in self.split_units(split))
        return f"{names}, element {index} (split {split})"

    def describe(self) -> str:
        return f"{self.name}({len(self.files)} files)"

    def identity(self) -> tuple[Any, ...]:
        files: Any = self.files if self.version is None else [f[0] for f in self.files]
        return (self.kind, self.version, files, self.parallel_reads, self.deterministic,
                self._format_options(), *self._options())

    def _format_options(self) -> tuple[Any, ...]:
        """What else of this source changes its elements (its reading options)."""
        return ()


def _without_bad(elements: Iterator[Any], stage: str,
                 policy: ErrorPolicy | None) -> Iterator[Any]:
    """``elements`` with each :class:`Bad` raised as the stage's PipelineError, or counted
    and dropped when ``policy`` skips errors; closing this closes ``elements`` (and the
    unit's file) at once."""
    try:
        for element in elements:
            if type(element) is Bad:
                if policy is None or not policy.settings.skip_errors:
                    raise PipelineError.from_exception(element.error, stage, element.where)
                policy.tally.skipped += 1
                continue
            yield element
    finally:
        close = getattr(elements, "close", None)
        if close is not None:
            close()


def _counted(elements: Iterator[Any], counters: list[_Counter],
             policy: ErrorPolicy | None) -> Iterator[Any]:
    try:
        yield from elements
    finally:
        if policy is not None:
            policy.tally.skipped += sum(c.tally.skipped for c in counters)


_ITEM, _END, _ERROR = "item", "end", "error"


def interleave(readers: Sequence[Callable[[], Iterator[Any]]],
               deterministic: bool = True) -> Iterator[Any]:
    """Run each of ``readers`` in a thread of its own and yield their elements as they
    come: in turn, one element of each (``deterministic``), or whichever is ready first.
    An exception of a reader is raised here; closing this iterator stops the threads.
    """
    stop = threading.Event()
    shared: queue.Queue[tuple[int, str, Any]] = queue.Queue(PARALLEL_READ_BUFFER * len(readers))
    queues = [queue.Queue[tuple[int, str, Any]](PARALLEL_READ_BUFFER) for _ in readers] \
        if deterministic else [shared] * len(readers)

    def put(out: queue.Queue[tuple[int, str, Any]], entry: tuple[int, str, Any]) -> bool:
        while not stop.is_set():
            try:
                out.put(entry, timeout=PARALLEL_READ_POLL)
                return True
            except queue.Full:
                continue
        return False

    def run(index: int, reader: Callable[[], Iterator[Any]]) -> None:
        out = queues[index]
        try:
            elements = reader()
            try:
                for element in elements:
                    if not put(out, (index, _ITEM, element)):
                        return
            finally:
                close = getattr(elements, "close", None)
                if close is not None:
                    close()
            put(out, (index, _END, None))
        except BaseException as exc:
            put(out, (index, _ERROR, exc))

    threads = [threading.Thread(target=run, args=(i, r), name=f"zloader-read-{i}", daemon=True)
               for i, r in enumerate(readers)]
    for thread in threads:
        thread.start()
    try:
        if deterministic:
            active = list(range(len(readers)))
            while active:
                for index in list(active):
                    _, kind, value = queues[index].get()
                    if kind == _ITEM:
                        yield value
                    elif kind == _END:
                        active.remove(index)
                    else:
                        raise value
        else:
            remaining = len(readers)
            while remaining:
                _, kind, value = shared.get()
                if kind == _ITEM:
                    yield value
                elif kind == _END:
                    remaining -= 1
                else:
                    raise value
    finally:
        stop.set()
        for thread in threads:
            thread.join(PARALLEL_READ_POLL * 10)
