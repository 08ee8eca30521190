"""``Pipeline``: an immutable chain of stages over a source.

Build one from a source constructor and chain stages; every method returns a new
Pipeline and leaves the receiver unchanged::

    pipeline = (Pipeline.from_files("data/*.jsonl", read_jsonl, shuffle_splits=True, seed=1)
                .map(tokenize, num_parallel_calls=4)
                .shuffle(10_000, seed=2)
                .batch(32, drop_remainder=True))
    for batch in pipeline.iter(epoch=3):
        ...

``pipeline.iter(epoch)`` runs it in this process: the reference semantics that every other
way of running it is tested against. With seeds set, each epoch is reproducible and epochs
differ from each other; with ``seed=None`` a random stage draws fresh entropy on every run.
"""

from __future__ import annotations

import itertools
import os
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from zloader import _check
from zloader import mixing as _mixing
from zloader import sources as _sources
from zloader import stages as _stages
from zloader._defaults import CACHE_MAX_ENTRY_BYTES
from zloader.chunks import Chunk
from zloader.fingerprint import Unhashable, prefix_fingerprints, warn_unshareable
from zloader.runs import Context, RunSettings

__all__ = ["Pipeline"]


def _callable_name(fn: Any) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return str(getattr(inner, "__name__", type(inner).__name__))


@dataclass(frozen=True, eq=False, repr=False)
class Pipeline:
    """An immutable chain of stages over a source. Build one with a source constructor
    (:meth:`range`, :meth:`from_items`, :meth:`from_arrays`, :meth:`from_files`,
    :meth:`from_torch`, :meth:`from_generator`, and the file formats :meth:`from_tfrecord`,
    :meth:`from_webdataset`, :meth:`from_parquet`, :meth:`from_jsonl`,
    :meth:`from_image_folder`), never by calling ``Pipeline()`` directly.
    """

    source: _sources.Source
    stages: tuple[_stages.Stage, ...] = ()

    # --- sources ---------------------------------------------------------------------

    @classmethod
    def range(cls, start_or_stop: int, stop: int | None = None, step: int = 1, *,
              split_size: int | None = None, shuffle_splits: bool = False,
              seed: int | None = None, name: str | None = None,
              version: str | None = None) -> Pipeline:
        """The integers of ``range(stop)`` or ``range(start, stop, step)``.

        Args:
            start_or_stop: ``stop`` when it is the only positional argument, else ``start``.
            stop: end of the range (exclusive).
            step: non-zero step.
            split_size: elements per split (default: at most 256 splits).
            shuffle_splits: read the splits in a seeded random order that changes each epoch.
            seed: seed of the split order (None: fresh each run).
            name: shown in errors and stats.
            version: pins the source's identity in the fingerprint.
        """
        if stop is None:
            start, stop = 0, _check.integer("stop", start_or_stop, -sys.maxsize)
        else:
            start = _check.integer("start", start_or_stop, -sys.maxsize)
            stop = _check.integer("stop", stop, -sys.maxsize)
        step = _check.integer("step", step, -sys.maxsize)
        if step == 0:
            raise ValueError("step must not be zero")
        length = len(range(start, stop, step))
        return cls(_sources.RangeSource(
            start=start, step=step, length=length,
            split_size=_sources.resolve_split_size(split_size, length),
            **_source_options("range", name, shuffle_splits, seed, version)))

    @classmethod
    def from_items(cls, items: Iterable[Any], *, split_size: int | None = None,
                   shuffle_splits: bool = False, seed: int | None = None,
                   name: str | None = None, version: str | None = None) -> Pipeline:
        """The items of a sequence, one element each (the sequence is copied into a tuple).

        Args:
            items: any finite iterable (a list, a tuple, a range).
            split_size, shuffle_splits, seed, name, version: as for :meth:`range`.
        """
        if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
            raise TypeError(f"items must be a list or other iterable of elements, got "
                            f"{type(items).__name__}")
        values = tuple(items)
        return cls(_sources.ItemsSource(
            items=values, length=len(values),
            split_size=_sources.resolve_split_size(split_size, len(values)),
            **_source_options("from_items", name, shuffle_splits, seed, version)))

    @classmethod
    def from_arrays(cls, structure: Any, *, split_size: int | None = None,
                    shuffle_splits: bool = False, seed: int | None = None,
                    name: str | None = None, version: str | None = None) -> Pipeline:
        """One element per row of equal-length arrays: ``{"x": X, "y": Y}`` yields
        ``{"x": X[i], "y": Y[i]}``. Nested dicts and tuples are allowed.

        The rows are read-only views (writing to one raises instead of corrupting the
        source); map to a copy to modify them. ``version=`` skips hashing the array bytes.

        Args:
            structure: an array, or a dict/tuple (nested) of arrays with equal first dims.
            split_size, shuffle_splits, seed, name, version: as for :meth:`range`.
        """
        checked, length = _sources.check_arrays(structure)
        return cls(_sources.ArraysSource(
            structure=checked, length=length,
            split_size=_sources.resolve_split_size(split_size, length),
            **_source_options("from_arrays", name, shuffle_splits, seed, version)))

    @classmethod
    def from_files(cls, paths_or_glob: Any, reader: Callable[[str], Iterable[Any]], *,
                   storage_options: dict[str, Any] | None = None,
                   shuffle_splits: bool = False, seed: int | None = None,
                   name: str | None = None, version: str | None = None) -> Pipeline:
        """The elements ``reader(path)`` yields for each file; one split per file.

        Args:
            paths_or_glob: a glob pattern (sorted matches; ``**`` recurses), one path, or a
                list of paths; URLs that fsspec understands too (``s3://...``). Paths are
                made absolute and stat'ed now: the fingerprint covers each file's size and
                modification time (an object's ETag).
            reader: ``reader(path)`` returns an iterable of elements; it is given the URL
                of a URL, to open with :func:`zloader.storage.open_file`.
            storage_options: fsspec's options for the URLs' filesystem.
            shuffle_splits, seed, name, version: as for :meth:`range`.

        Raises:
            ValueError: a path does not exist or is not a file, or the pattern matches none.
        """
        _check.function("reader", reader)
        files = _sources.list_files(paths_or_glob, storage_options)
        return cls(_sources.FilesSource(
            files=files, reader=reader,
            **_source_options("from_files", name, shuffle_splits, seed, version)))

    @classmethod
    def from_torch(cls, dataset: Any, *, split_size: int | None = None,
                   shuffle_splits: bool = False, seed: int | None = None,
                   name: str | None = None, version: str | None = None) -> Pipeline:
        """``dataset[i]`` for ``i`` in ``range(len(dataset))``: a map-style dataset (anything
        with ``__len__`` and ``__getitem__``, such as ``torch.utils.data.Dataset``).

        Elements are what the dataset returns. The length is read once, now.

        Args:
            dataset: the map-style dataset.
            split_size, shuffle_splits, seed, name, version: as for :meth:`range`.
        """
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(f"from_torch needs a map-style dataset with __len__ and "
                            f"__getitem__, got {type(dataset).__name__}; for an iterable "
                            "dataset use Pipeline.from_generator")
        length = len(dataset)
        return cls(_sources.TorchSource(
            dataset=dataset, length=length,
            split_size=_sources.resolve_split_size(split_size, length),
            **_source_options("from_torch", name, shuffle_splits, seed, version)))

    @classmethod
    def from_generator(cls, fn: Callable[[Any], Iterable[Any]], splits: Sequence[Any] | int,
                       *, shuffle_splits: bool = False, seed: int | None = None,
                       name: str | None = None, version: str | None = None) -> Pipeline:
        """The elements ``fn(split)`` yields for each split.

        Args:
            fn: ``fn(split)`` returns an iterable of elements.
            splits: the split values (shard names, URLs, index ranges...), or an int ``n``
                for ``range(n)``. They are hashed into the fingerprint.
            shuffle_splits, seed, name, version: as for :meth:`range`.
        """
        _check.function("fn", fn)
        if isinstance(splits, int) and not isinstance(splits, bool):
            values: tuple[Any, ...] = tuple(range(_check.integer("splits", splits, 0)))
        elif isinstance(splits, (str, bytes)) or not isinstance(splits, Iterable):
            raise TypeError(f"splits must be a sequence of split values or an int, got "
                            f"{type(splits).__name__}")
        else:
            values = tuple(splits)
        default = f"from_generator({_callable_name(fn)})"
        return cls(_sources.GeneratorSource(
            fn=fn, splits=values,
            **_source_options(default, name, shuffle_splits, seed, version)))

    # --- file formats (docs/sources.md) ----------------------------------------------
    # Each takes a glob, a path or URL, or a list of them (fsspec URLs with
    # ``storage_options``), and ``parallel_reads=k``: a worker reads k units at once,
    # interleaved (``deterministic``: in turn, the same order every run).

    @classmethod
    def from_tfrecord(cls, paths: Any, compression: str | None = None, verify: bool = True,
                      *, storage_options: dict[str, Any] | None = None,
                      parallel_reads: int = 1, deterministic: bool = True,
                      shuffle_splits: bool = False, seed: int | None = None,
                      name: str | None = None, version: str | None = None,
                      max_record_bytes: int | None = None) -> Pipeline:
        """The raw records (bytes) of TFRecord files; one split per file. ``compression``:
        None, ``"GZIP"`` or ``"ZLIB"``; ``verify`` checks each record's checksums (a
        corrupt record raises naming its file and offset, or is skipped under
        ``on_error="skip"``). ``max_record_bytes``: the largest record read (default
        ``MAX_RECORD_BYTES``, 256 MiB); a longer length is a corrupt record. Parse records
        with :func:`zloader.formats.parse_example`."""
        from zloader.formats import build as _build  # (only for these sources)

        return cls(_build.tfrecord(paths, compression, verify, storage_options,
                                   parallel_reads, deterministic, _source_options(
                                       "from_tfrecord", name, shuffle_splits, seed, version),
                                   max_record_bytes))

    @classmethod
    def from_webdataset(cls, urls: Any, *, storage_options: dict[str, Any] | None = None,
                        parallel_reads: int = 1, deterministic: bool = True,
                        shuffle_splits: bool = False, seed: int | None = None,
                        name: str | None = None, version: str | None = None,
                        max_member_bytes: int | None = None) -> Pipeline:
        """The samples of WebDataset tar shards, ``{"__key__", "__url__", ext: bytes}``
        grouped by key as the ``webdataset`` package does; one split per shard.
        ``max_member_bytes``: the largest member read (default ``MAX_MEMBER_BYTES``,
        256 MiB); a sample with a larger one is an error."""
        from zloader.formats import build as _build  # (only for these sources)

        return cls(_build.webdataset(urls, storage_options, parallel_reads, deterministic,
                                     _source_options("from_webdataset", name, shuffle_splits,
                                                     seed, version), max_member_bytes))

    @classmethod
    def from_parquet(cls, paths: Any, columns: Sequence[str] | None = None,
                     batch_rows: int | None = None, *,
                     storage_options: dict[str, Any] | None = None, parallel_reads: int = 1,
                     deterministic: bool = True, shuffle_splits: bool = False,
                     seed: int | None = None, name: str | None = None,
                     version: str | None = None) -> Pipeline:
        """The rows of Parquet files as dicts (only ``columns`` when given), or with
        ``batch_rows`` column batches of up to that many rows; one split per row group."""
        from zloader.formats import build as _build  # (only for these sources)

        return cls(_build.parquet(paths, columns, batch_rows, storage_options, parallel_reads,
                                  deterministic, _source_options(
                                      "from_parquet", name, shuffle_splits, seed, version)))

    @classmethod
    def from_jsonl(cls, paths: Any, *, storage_options: dict[str, Any] | None = None,
                   parallel_reads: int = 1, deterministic: bool = True,
                   shuffle_splits: bool = False, seed: int | None = None,
                   name: str | None = None, version: str | None = None,
                   max_line_bytes: int | None = None) -> Pipeline:
        """The JSON value of each line of JSON lines files (``.gz``/``.zst`` too); one split
        per file. ``max_line_bytes``: the longest line read (default ``MAX_LINE_BYTES``,
        16 MiB); a longer one is an error for that line."""
        from zloader.formats import build as _build  # (only for these sources)

        return cls(_build.jsonl(paths, storage_options, parallel_reads, deterministic,
                                _source_options("from_jsonl", name, shuffle_splits, seed,
                                                version), max_line_bytes))

    @classmethod
    def from_image_folder(cls, root: Any, *, split_size: int | None = None,
                          decode: bool = False,
                          storage_options: dict[str, Any] | None = None,
                          parallel_reads: int = 1, deterministic: bool = True,
                          shuffle_splits: bool = False, seed: int | None = None,
                          name: str | None = None, version: str | None = None,
                          max_pixels: int | None = None) -> Pipeline:
        """``{"image", "label", "path"}`` for each image of ``root/<class>/...``, classes
        and labels as torchvision's ``ImageFolder`` (``pipeline.source.classes``); the
        image's bytes, or an HWC uint8 array with ``decode=True``. One split per
        ``split_size`` images (default: at most 256 splits). ``max_pixels``: with
        ``decode``, the largest image decoded (default ``MAX_IMAGE_PIXELS``, 8192 x 8192);
        a larger one is an error for that image."""
        from zloader.formats import build as _build  # (only for these sources)

        return cls(_build.image_folder(root, split_size, decode, storage_options,
                                       parallel_reads, deterministic, _source_options(
                                           "from_image_folder", name, shuffle_splits, seed,
                                           version), max_pixels))

    @classmethod
    def mix(cls, pipelines: Sequence[Pipeline], weights: Sequence[float] | None = None, *,
            seed: int | None = None, stop: str = "all_exhausted") -> Pipeline:
        """Each element from one of ``pipelines``, drawn by ``weights`` (equal when None)
        with a generator seeded by ``seed`` (fresh entropy per run when None). Each input
        keeps its own splits, shuffles and maps. ``stop``: ``"all_exhausted"`` (an input
        that ends leaves the draw and the others are drawn by their weights, re-scaled),
        ``"first_exhausted"`` (the mix ends with its first input to end) or ``"never"``
        (an input that ends starts its next pass: the mix is endless). See
        docs/semantics.md, "Mixing".

        Raises:
            TypeError: an input is not a Pipeline, ``weights`` is not a sequence of real
                numbers (a string is refused), or ``seed`` is not an int.
            ValueError: no inputs, an input that is a mix or has a take/skip, weights not
                one per input, negative, not finite or all zero, a ``seed`` outside
                [0, 2**64), or an unknown ``stop``.
        """
        return cls(_mixing.mixed_source(_pipelines(pipelines), weights, None, seed, stop))

    @classmethod
    def choose(cls, pipelines: Sequence[Pipeline], pattern: Sequence[int], *,
               stop: str = "all_exhausted") -> Pipeline:
        """Elements from ``pipelines`` in the order ``pattern`` names them, over and over
        (``[0, 0, 1]``: two of input 0, then one of input 1). ``stop``: as for
        :meth:`mix`; ``"all_exhausted"`` passes over the inputs that ended.

        Raises:
            TypeError: an input is not a Pipeline.
            ValueError: as for :meth:`mix`, and a pattern that is empty or names no input.
        """
        return cls(_mixing.mixed_source(_pipelines(pipelines), None, pattern, None, stop))

    # --- stages ----------------------------------------------------------------------

    def map(self, fn: Callable[[Any], Any], num_parallel_calls: int = 1, *,
            name: str | None = None, version: str | None = None) -> Pipeline:
        """Apply ``fn`` to every element.

        Args:
            fn: a function of one element.
            num_parallel_calls: calls in flight at once on threads of this process (results
                keep their order); helps when ``fn`` releases the GIL (I/O, numpy, decoding).
            name: shown in errors and stats (default ``"map(<fn name>)"``).
            version: pins the stage's identity; ``fn`` is then not hashed.
        """
        _check.function("fn", fn)
        return self._then(_stages.Map(
            fn=fn, num_parallel_calls=_check.integer("num_parallel_calls", num_parallel_calls, 1),
            **_stage_options(f"map({_callable_name(fn)})", name, version)))

    def filter(self, predicate: Callable[[Any], Any], *, name: str | None = None,
               version: str | None = None) -> Pipeline:
        """Keep the elements for which ``predicate(element)`` is true."""
        _check.function("predicate", predicate)
        return self._then(_stages.Filter(
            predicate=predicate,
            **_stage_options(f"filter({_callable_name(predicate)})", name, version)))

    def shuffle(self, buffer_size: int, seed: int | None = None,
                reshuffle_each_epoch: bool = True, *, name: str | None = None,
                version: str | None = None) -> Pipeline:
        """Shuffle through a buffer of ``buffer_size`` elements (tf.data's algorithm).

        Args:
            buffer_size: elements held; ``>=`` the input size gives a uniform shuffle.
            seed: None draws fresh entropy on every run.
            reshuffle_each_epoch: False repeats epoch 0's order (given the same input) in
                every epoch and repetition.
        """
        return self._then(_stages.Shuffle(
            buffer_size=_check.integer("buffer_size", buffer_size, 1),
            seed=_check.seed(seed),
            reshuffle_each_epoch=_check.boolean("reshuffle_each_epoch", reshuffle_each_epoch),
            **_stage_options(f"shuffle({buffer_size})", name, version)))

    def batch(self, batch_size: int, drop_remainder: bool = False, *,
              name: str | None = None, version: str | None = None) -> Pipeline:
        """Group ``batch_size`` consecutive elements into one (see :mod:`zloader.collate`
        for how leaves are stacked); the last, smaller batch is kept unless
        ``drop_remainder``."""
        return self._then(_stages.Batch(
            batch_size=_check.integer("batch_size", batch_size, 1),
            drop_remainder=_check.boolean("drop_remainder", drop_remainder),
            **_stage_options(f"batch({batch_size})", name, version)))

    def bucket_by_length(self, length_fn: Callable[[Any], int], boundaries: Sequence[int],
                         batch_sizes: Sequence[int], pad_value: Any = 0,
                         drop_remainder: bool = False, *, name: str | None = None,
                         version: str | None = None) -> Pipeline:
        """Batch elements of similar length together, as tf.data's
        ``bucket_by_sequence_length``: bucket ``i`` holds the elements whose
        ``length_fn(element)`` is in ``[boundaries[i-1], boundaries[i])`` (bucket 0 from 0,
        the last one without end) and emits a batch each time it holds ``batch_sizes[i]``
        of them. Arrays in a batch are padded with ``pad_value`` along axis 0 to the
        batch's longest (in nested structures too; other leaves batch as in :meth:`batch`).

        In a coordinated job (``Loader(num_consumers=N, ...)``) each bucket emits N batches
        at once, so that every consumer's batch of a round comes from the same bucket; the
        end of the input then drops each bucket's last, incomplete round (counted in
        ``Loader.stats()["dropped"]``).

        Args:
            length_fn: a function of one element returning its length, an int >= 0.
            boundaries: strictly increasing ints > 0.
            batch_sizes: ``len(boundaries) + 1`` batch sizes, one per bucket, each >= 1.
            pad_value: the value padding fills arrays with (default 0).
            drop_remainder: drop each bucket's last, smaller batch at the end of the input.

        Raises:
            ValueError / TypeError: a bad argument, named in the message.
        """
        _check.function("length_fn", length_fn)
        bounds = _int_tuple("boundaries", boundaries, 1)
        if any(b <= a for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"boundaries must be strictly increasing, got {list(bounds)}")
        sizes = _int_tuple("batch_sizes", batch_sizes, 1)
        if len(sizes) != len(bounds) + 1:
            raise ValueError(f"batch_sizes needs len(boundaries) + 1 = {len(bounds) + 1} "
                             f"entries (one per bucket), got {len(sizes)}")
        if not isinstance(pad_value, (bool, int, float, complex)):
            raise TypeError(f"pad_value must be a number, got {type(pad_value).__name__}")
        return self._then(_stages.BucketByLength(
            length_fn=length_fn, boundaries=bounds, batch_sizes=sizes, pad_value=pad_value,
            drop_remainder=_check.boolean("drop_remainder", drop_remainder),
            **_stage_options(f"bucket_by_length({_callable_name(length_fn)})", name,
                             version)))

    def unbatch(self, *, name: str | None = None, version: str | None = None) -> Pipeline:
        """Split each element along axis 0 into its rows (the inverse of :meth:`batch`)."""
        return self._then(_stages.Unbatch(**_stage_options("unbatch", name, version)))

    def repeat(self, count: int | None = None, *, name: str | None = None,
               version: str | None = None) -> Pipeline:
        """Repeat everything before this stage ``count`` times, or forever when None.

        Each repetition re-runs the stages before it with a new pass key, so seeded
        shuffles and split orders differ between repetitions (and stay reproducible). An
        endless repeat whose input turns out empty ends instead of spinning.
        """
        return self._then(_stages.Repeat(
            count=_check.optional_integer("count", count, 0),
            **_stage_options(f"repeat({count})", name, version)))

    def take(self, n: int, *, name: str | None = None, version: str | None = None) -> Pipeline:
        """The first ``n`` elements (fewer if the input ends first)."""
        return self._then(_stages.Take(count=_check.integer("n", n, 0),
                                       **_stage_options(f"take({n})", name, version)))

    def skip(self, n: int, *, name: str | None = None, version: str | None = None) -> Pipeline:
        """All but the first ``n`` elements."""
        return self._then(_stages.Skip(count=_check.integer("n", n, 0),
                                       **_stage_options(f"skip({n})", name, version)))

    def cache(self, path: Any = None, *, storage_options: dict[str, Any] | None = None,
              max_entry_bytes: int = CACHE_MAX_ENTRY_BYTES) -> Pipeline:
        """Keep what the stages so far produce from each split, and read it back after.

        The first time a split is read (in any epoch, by any job) its elements are computed
        and written to ``path``; the entry is committed when the split was read to its end
        (an abandoned or failed split leaves nothing). Later epochs, and other jobs whose
        stages before the cache have the same fingerprint, read the committed entries
        instead of computing them. A corrupt or truncated entry is logged and recomputed.
        Elements are stored as the codec encodes them (never pickled); arrays read back
        are read-only. Whatever the stages before it do at random is frozen by the cache.
        See docs/cache.md, and ``zloader cache ls|rm`` to see and clear entries.

        Args:
            path: a folder, or a URL that fsspec understands (``s3://bucket/cache``);
                default ``$ZLOADER_CACHE_DIR``, else ``~/.cache/zloader/cache`` (under
                ``$XDG_CACHE_HOME`` when set). Resolved now, where the pipeline is built.
            storage_options: fsspec's options for the URL's filesystem.
            max_entry_bytes: the largest entry (one split's output) written or read back,
                which a worker holds in memory whole; a larger split is read uncached.

        Raises:
            ValueError: a stage other than ``map``, ``filter`` or ``unbatch`` comes before
                the cache (move ``.cache()`` before it), those stages cannot be
                fingerprinted, or ``max_entry_bytes`` is below 1.
        """
        from zloader import cache as _cache  # (only for .cache())

        return Pipeline(_cache.cached(self.source, self.stages, path, storage_options,
                                      max_entry_bytes))

    def _then(self, stage: _stages.Stage) -> Pipeline:
        return Pipeline(self.source, (*self.stages, stage))

    # --- running ---------------------------------------------------------------------

    def iter(self, epoch: int = 0) -> Iterator[Any]:
        """Run the pipeline in this process for ``epoch`` and yield its elements.

        Raises:
            PipelineError: user code (or a batch of mismatched elements) failed; it names
                the stage and carries the original traceback.
        """
        epoch = _check.integer("epoch", epoch, 0)
        ctx = Context(RunSettings(entropy=random.SystemRandom().getrandbits(63)),
                      source=self.source)

        def read(key: _stages.Key) -> Iterator[Any]:
            for split in ctx.source.split_order(key, ctx.settings.entropy):
                yield from ctx.read(split)

        def read_chunks(key: _stages.Key, size: int) -> Iterator[Chunk]:
            for split in ctx.source.split_order(key, ctx.settings.entropy):
                yield from ctx.read_chunks(split, size)

        return _mixing.mixed_run(self.source, read, self.stages, ctx, read_chunks)((epoch,))

    def __iter__(self) -> Iterator[Any]:
        return self.iter(0)

    # --- identity --------------------------------------------------------------------

    @cached_property
    def _fingerprints(self) -> tuple[tuple[str, ...], str | None]:
        """Each prefix's fingerprint (:attr:`prefix_fingerprints`), and what could not be
        hashed (None: all could)."""
        parts = [(self.source.name, self.source.identity())]
        parts += [(stage.name, stage.identity()) for stage in self.stages]
        found: list[str] = []
        try:
            found.extend(prefix_fingerprints(parts))
        except Unhashable as exc:
            warn_unshareable(exc.culprit)
            found += [os.urandom(32).hex() for _ in range(len(parts) - len(found))]
            return tuple(found), exc.culprit
        return tuple(found), None

    @property
    def fingerprint(self) -> str:
        """A hex string equal for equal definitions, here or in another process or host.

        See :mod:`zloader.fingerprint` for exactly what is hashed. Computed once, on first
        access. When part of the pipeline cannot be hashed soundly, a
        :class:`~zloader.errors.FingerprintWarning` names it, :attr:`shareable` is False
        and the fingerprint is random, so it matches no other pipeline.
        """
        return self._fingerprints[0][-1]

    @property
    def prefix_fingerprints(self) -> tuple[str, ...]:
        """The fingerprint of each prefix of the pipeline: its source alone, then with its
        first stage, and so on, the last being :attr:`fingerprint`. Pipelines that begin
        alike (the same source and first stages) have equal prefix fingerprints that far;
        from a part that cannot be hashed on, they are random."""
        return self._fingerprints[0]

    @property
    def shareable(self) -> bool:
        """Whether the fingerprint is sound, so that other trainers may share this pipeline."""
        return self._fingerprints[1] is None

    def __repr__(self) -> str:
        chain = " -> ".join([self.source.describe(), *(s.name for s in self.stages)])
        return f"Pipeline({chain})"


def _source_options(default_name: str, name: Any, shuffle_splits: Any, seed: Any,
                    version: Any) -> dict[str, Any]:
    return {
        "name": _check.label("name", name) or default_name,
        "shuffle_splits": _check.boolean("shuffle_splits", shuffle_splits),
        "seed": _check.seed(seed),
        "version": _check.label("version", version),
    }


def _int_tuple(name: str, values: Any, minimum: int) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    return tuple(_check.integer(f"{name}[{i}]", v, minimum) for i, v in enumerate(values))


def _stage_options(default_name: str, name: Any, version: Any) -> dict[str, Any]:
    return {"name": _check.label("name", name) or default_name,
            "version": _check.label("version", version)}


def _pipelines(inputs: Sequence[Any]) -> list[Pipeline]:
    """A mix's inputs, each a Pipeline.

    Raises:
        TypeError: one is not.
    """
    found = list(inputs)
    for index, pipeline in enumerate(found):
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"mix input {index} must be a zloader.Pipeline, "
                            f"got {type(pipeline).__name__}")
    return found
