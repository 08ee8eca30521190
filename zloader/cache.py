"""``Pipeline.cache(path)``: compute a prefix once, then read what it produced.

``p.map(decode).cache()`` returns a pipeline whose source is a :class:`CachedSource`: it
has the splits of ``p``'s source, and reading split ``n`` yields the committed entry of
split ``n`` when there is a valid one; otherwise it reads the split through the stages
before ``.cache()``, yields their elements and writes them to a temporary file, which it
renames into place (*commits*) only when the split was read to its end. A split abandoned
midway (the consumer stopped, a worker was killed, user code raised) leaves no entry. The
entry's key is the prefix's fingerprint and the split number, so a later epoch, another job
or another host with the same prefix and the same cache path reads it; a corrupt or
truncated entry is logged, ignored and written again. File layout and locations:
:mod:`zloader.cachefile`; documentation: docs/cache.md.

Only ``map``, ``filter`` and ``unbatch`` may come before ``.cache()``: they work element
by element within a split, so each split's output is its own. What the prefix does at
random is frozen by the cache, as with tf.data's ``cache``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from zloader import _check
from zloader import stages as _stages
from zloader._defaults import CACHE_DIR_VARIABLE, CACHE_MAX_ENTRY_BYTES
from zloader.cachefile import (
    BadEntry,
    CacheWriteError,
    EntryFile,
    EntryWriter,
    Store,
    is_fingerprint,
    open_entry,
)
from zloader.errors import PipelineError
from zloader.fingerprint import Unhashable, fingerprint
from zloader.runs import Context, RunSettings
from zloader.sources import ErrorPolicy, Source
from zloader.storage import is_url

__all__ = ["CachedSource", "Summary", "cached", "default_dir", "location", "remove",
           "summaries"]

log = logging.getLogger("zloader.cache")

PREFIX_STAGES = (_stages.Map, _stages.Filter, _stages.Unbatch)
"""The stages that may come before ``.cache()``: they work element by element, so each
split's output is its own."""


def default_dir() -> str:
    """The cache folder when no path is given: ``$ZLOADER_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/zloader/cache``, else ``~/.cache/zloader/cache``."""
    chosen = os.environ.get(CACHE_DIR_VARIABLE)
    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "zloader", "cache")


def location(path: Any = None) -> str:
    """The cache location ``path`` names: an absolute local path (``file://`` URLs too), or
    a URL for fsspec; :func:`default_dir` when None."""
    if path is None:
        path = default_dir()
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"cache: path must be a folder or a URL, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise TypeError("cache: path must be a non-empty str or path-like")
    text = text.removeprefix("file://")
    if is_url(text):
        return text.rstrip("/")
    return os.path.abspath(os.path.expanduser(text))


def cached(source: Source, stages: tuple[_stages.Stage, ...], path: Any,
           storage_options: dict[str, Any] | None,
           max_entry_bytes: int = CACHE_MAX_ENTRY_BYTES) -> CachedSource:
    """The source of ``Pipeline(source, stages).cache(path)``.

    Raises:
        ValueError: the source is a mix, a stage other than map, filter or unbatch comes
            before the cache, the prefix cannot be fingerprinted (its entries could never
            be found again), or ``max_entry_bytes`` is below 1.
    """
    limit = _check.integer("cache: max_entry_bytes", max_entry_bytes, 1)
    if source.kind == "mix":
        raise ValueError("cache: a mix's splits are its inputs' and go through their stages "
                         "first; cache each input (Pipeline.mix([a.cache(), b.cache()]))")
    for stage in stages:
        if not isinstance(stage, PREFIX_STAGES):
            raise ValueError(
                f"cache: stage {stage.name!r} comes before .cache(), but only map, filter "
                f"and unbatch may: the cache keeps each split's output, and a {stage.kind} "
                f"mixes, groups or counts elements across splits; move .cache() before "
                f"{stage.name!r}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"cache: storage_options must be a dict (fsspec's options for the "
                        f"URL's filesystem), got {type(storage_options).__name__}")
    parts = [(source.name, source.identity()), *((s.name, s.identity()) for s in stages)]
    try:
        key = fingerprint(parts)
    except Unhashable as exc:
        raise ValueError(f"cache: the stages before .cache() cannot be fingerprinted "
                         f"({exc.culprit}), so their entries could never be found again: "
                         "give the stage version= to pin its identity") from None
    return CachedSource(name=f"cache({source.name})", shuffle_splits=source.shuffle_splits,
                        seed=source.seed, version=None, source=source, stages=tuple(stages),
                        key=key, root=location(path), storage_options=storage_options,
                        max_entry_bytes=limit)


@dataclass(frozen=True, eq=False, kw_only=True)
class CachedSource(Source):
    """The splits of ``source`` read through ``stages``, each kept at ``root`` under
    ``key`` (the prefix's fingerprint) once it was read whole.

    The fingerprint of a pipeline over it hashes the prefix (``source`` and ``stages``),
    not the location (nor ``max_entry_bytes``, the largest entry written or read): the same
    prefix cached in two places yields the same elements.
    """

    kind: ClassVar[str] = "cache"
    source: Source
    stages: tuple[_stages.Stage, ...]
    key: str
    root: str
    storage_options: dict[str, Any] | None
    max_entry_bytes: int = CACHE_MAX_ENTRY_BYTES

    @property
    def num_splits(self) -> int:
        return self.source.num_splits

    def split_order(self, key: _stages.Key, entropy: int) -> Any:
        return self.source.split_order(key, entropy)

    def innermost(self) -> Source:
        return self.source.innermost()

    def with_innermost(self, source: Source) -> Source:
        return dataclasses.replace(self, source=self.source.with_innermost(source))

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.source.identity(), tuple(s.identity() for s in self.stages))

    def describe(self) -> str:
        return " -> ".join([self.source.describe(), *(s.name for s in self.stages), "cache"])

    def locate(self, split: int, index: int) -> str:
        return f"element {index} of cached split {split} of {self.source.describe()}"

    def read(self, split: int, policy: ErrorPolicy | None = None) -> Iterator[Any]:
        """The elements of ``split``: its committed entry, or computed (and written)."""
        store = Store(self.root, self.storage_options)
        elements = self._entry(store, split)
        if elements is not None:
            return elements
        return self._compute(store, split, policy)

    def _entry(self, store: Store, split: int) -> Iterator[Any] | None:
        """The elements of the valid entry of ``split``, or None (none, or a bad one).

        The entry is read into memory and every element decoded once before the first is
        yielded, so nothing in it (a FIFO, a link, a truncation by another process, a
        value the codec refuses) can fail the split after it began: it is computed
        instead."""
        where = store.path(self.key, split)
        try:
            data = store.load(self.key, split, self.max_entry_bytes)
            if data is None:
                return None
            entry = open_entry(data, self.key, split)
        except BadEntry as exc:
            log.warning("cache: ignoring %s: %s; computing split %d again and rewriting it",
                        where, exc, split)
            return None
        except OSError as exc:  # StorageError too
            log.warning("cache: cannot read %s (%s); computing split %d", where, exc, split)
            return None
        return entry.elements()

    def _compute(self, store: Store, split: int,
                 policy: ErrorPolicy | None) -> Iterator[Any]:
        """Run the prefix on ``split``, yielding its elements while writing them; commit
        the entry only at the end of the split, and only when no error was skipped (a
        later run with another ``on_error`` must see the error)."""
        skip = bool(policy is not None and policy.settings.skip_errors)
        ctx = Context(RunSettings(entropy=0, skip_errors=skip), source=self.source)
        elements = _stages.compose(lambda key: ctx.read(split), self.stages, ctx)(())
        try:
            with contextlib.ExitStack() as stack:
                stack.callback(getattr(elements, "close", lambda: None))
                writing = self._begin(stack, store, split)
                for index, element in enumerate(elements):
                    if writing is not None:
                        writing = self._add(writing, element, store, split, index)
                    yield element
                if writing is not None and ctx.tally.skipped == 0:
                    self._commit(writing, store, split)
        finally:
            if policy is not None:
                policy.tally.skipped += ctx.tally.skipped

    def _begin(self, stack: contextlib.ExitStack, store: Store,
               split: int) -> tuple[EntryWriter, Any] | None:
        try:
            file, commit = stack.enter_context(store.writing(self.key, split))
            return EntryWriter(file, self.key, split), commit
        except (OSError, BadEntry) as exc:  # BadEntry: the folder is a link, not followed
            log.warning("cache: cannot write %s (%s); split %d is read without caching",
                        store.path(self.key, split), exc, split)
            return None

    def _add(self, writing: tuple[EntryWriter, Any], element: Any, store: Store, split: int,
             index: int) -> tuple[EntryWriter, Any] | None:
        try:
            writing[0].add(element)
        except CacheWriteError as exc:
            raise PipelineError.from_exception(exc, self.name,
                                               self.locate(split, index)) from None
        except OSError as exc:
            log.warning("cache: cannot write %s (%s); split %d is read without caching",
                        store.path(self.key, split), exc, split)
            return None
        if writing[0].size > self.max_entry_bytes:
            log.warning("cache: split %d's entry would pass max_entry_bytes (%d bytes) at "
                        "element %d: it is read without caching (an entry is read into "
                        "memory whole); raise Pipeline.cache(max_entry_bytes=) to cache it, "
                        "or make the splits smaller", split, self.max_entry_bytes, index)
            return None
        return writing

    def _commit(self, writing: tuple[EntryWriter, Any], store: Store, split: int) -> None:
        writer, commit = writing
        try:
            writer.finish()
            commit()
        except OSError as exc:
            log.warning("cache: cannot commit %s (%s); split %d stays uncached",
                        store.path(self.key, split), exc, split)


# --- what `zloader cache ls|rm` shows and removes -------------------------------------------

@dataclass(frozen=True)
class Summary:
    """The entries of one fingerprint at a location."""

    fingerprint: str
    splits: int
    bytes: int
    last_written: float
    temporary: int

    def to_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "splits": self.splits, "bytes": self.bytes,
                "last_written": self.last_written, "temporary": self.temporary}


def summaries(store: Store) -> list[Summary]:
    """One :class:`Summary` per fingerprint folder at ``store``, by fingerprint.

    Raises:
        FileNotFoundError: there is no folder at the location.
    """
    by_key: dict[str, list[EntryFile]] = {}
    for file in store.files():
        by_key.setdefault(file.fingerprint, []).append(file)
    return [Summary(key, sum(f.split is not None for f in files),
                    sum(f.size for f in files if f.split is not None),
                    max(f.mtime for f in files), sum(f.temporary for f in files))
            for key, files in sorted(by_key.items())]


def remove(store: Store, fingerprint: str | None = None, everything: bool = False,
           stale: float | None = None) -> list[EntryFile]:
    """Delete entries and temporary files at ``store``: those of ``fingerprint`` (a prefix
    of one is enough), or every one (``everything``), or (``stale``) only the temporary
    files untouched for that many seconds, which writers killed midway leave. Returns what
    was removed. Only the cache's own files are touched: regular files named as it names
    entries and temporary files, never through a symbolic link (:meth:`Store.files`).

    Raises:
        ValueError: not exactly one choice, or a fingerprint prefix that is not hex or
            matches several fingerprints.
        LookupError: a fingerprint prefix that matches none.
        FileNotFoundError: there is no folder at the location.
    """
    if (fingerprint is not None) + bool(everything) + (stale is not None) != 1:
        raise ValueError("give exactly one of a fingerprint, everything or stale")
    files = store.files()
    if fingerprint is not None:
        if not fingerprint or not is_fingerprint(fingerprint.ljust(64, "0")):
            raise ValueError(f"not a fingerprint (hex digits): {fingerprint!r}")
        keys = {f.fingerprint for f in files if f.fingerprint.startswith(fingerprint)}
        if not keys:
            raise LookupError(f"no entries of a fingerprint {fingerprint!r} at {store.root} "
                              "(`zloader cache ls` lists them)")
        if len(keys) > 1:
            raise ValueError(f"{fingerprint!r} matches {len(keys)} fingerprints: give more "
                             "of it")
        chosen = [f for f in files if f.fingerprint in keys]
    elif everything:
        chosen = files
    else:
        cutoff = time.time() - float(stale or 0.0)
        chosen = [f for f in files if f.temporary and f.mtime < cutoff]
    return [file for file in chosen if store.remove(file)]

