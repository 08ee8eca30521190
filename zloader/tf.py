"""TensorFlow adapters: ``tf.data.Dataset`` s over a zloader Pipeline.

This module is the only one in zloader that imports tensorflow; import it explicitly
(``import zloader.tf``). :func:`dataset` reads the pipeline through a zloader
:class:`~zloader.Loader` (worker processes); :func:`to_dataset` runs it in the iterating
process. Both are built on ``tf.data.Dataset.from_generator``; each iteration of the
returned dataset is one epoch, so ``model.fit(ds, epochs=N)`` works.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from zloader import _check
from zloader._defaults import TF_PROBE
from zloader.errors import PipelineError
from zloader.loader import Loader
from zloader.pipeline import Pipeline
from zloader.stages import Batch, BucketByLength, Map, Shuffle, Skip, Stage, Take

__all__ = ["close", "dataset", "element_spec", "infer_signature", "to_dataset"]


def element_spec(element: Any) -> Any:
    """The ``tf.TensorSpec`` structure matching one element, with every dimension left
    unknown (so a shorter last batch still fits).

    Arrays and numpy scalars keep their dtype; Python ``int`` -> int64, ``float`` ->
    float64, ``bool`` -> bool, ``str``/``bytes`` -> string; a list of strings (as ``batch``
    makes them) -> a 1-d string tensor; dicts and tuples keep their structure and other
    lists become tuples.

    Raises:
        TypeError: the element holds a value tf.data cannot represent (``None``, objects).
    """
    if isinstance(element, (np.ndarray, np.generic)) and not isinstance(element, (str, bytes)):
        array = np.asarray(element)
        return tf.TensorSpec([None] * array.ndim, tf.as_dtype(array.dtype))
    if isinstance(element, bool):
        return tf.TensorSpec([], tf.bool)
    if isinstance(element, int):
        return tf.TensorSpec([], tf.int64)
    if isinstance(element, float):
        return tf.TensorSpec([], tf.float64)
    if isinstance(element, (str, bytes)):
        return tf.TensorSpec([], tf.string)
    if isinstance(element, dict):
        return {key: element_spec(value) for key, value in element.items()}
    if isinstance(element, list) and element and all(isinstance(v, (str, bytes))
                                                     for v in element):
        return tf.TensorSpec([None], tf.string)
    if isinstance(element, (list, tuple)):
        return tuple(element_spec(value) for value in element)
    raise TypeError(f"tf.data cannot hold a {type(element).__name__}; map it to an array or "
                    "drop it in a map stage")


def _as_tf_structure(element: Any) -> Any:
    """Lists that are structure become tuples, as in :func:`element_spec`."""
    if isinstance(element, dict):
        return {key: _as_tf_structure(value) for key, value in element.items()}
    if isinstance(element, list) and element and all(isinstance(v, (str, bytes))
                                                     for v in element):
        return element
    if isinstance(element, (list, tuple)):
        return tuple(_as_tf_structure(value) for value in element)
    return element


def to_dataset(pipeline: Pipeline, spec: Any = None, epoch: int = 0) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` that yields the pipeline's elements, one epoch per iteration.

    Args:
        pipeline: the pipeline to run.
        spec: the ``output_signature`` (``tf.TensorSpec`` s, checked); by default the
            dtypes and ranks of :func:`infer_signature` with ``probe=1`` (one element
            through the stages, buffers bypassed) with every dimension unknown. Pass one
            to keep static shapes.
        epoch: the epoch of the first iteration; each later iteration runs the next one.

    Raises:
        TypeError: ``pipeline`` is not a Pipeline, ``spec`` is not made of
            ``tf.TypeSpec`` s, or the elements cannot be tf tensors.
        ValueError: ``spec`` is None and the pipeline yields nothing to infer it from.
    """
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"pipeline must be a zloader.Pipeline, got {type(pipeline).__name__}")
    epochs = itertools.count(_check.integer("epoch", epoch, 0))
    if spec is None:
        try:
            learned = infer_signature(pipeline, 1)
        except ValueError as exc:
            raise ValueError("cannot infer the element spec of a pipeline that yields "
                             "nothing; pass spec=") from exc
        spec = tf.nest.map_structure(
            lambda sp: tf.TensorSpec([None] * sp.shape.rank, sp.dtype), learned)
    else:
        _checked("spec", spec)

    def generate() -> Iterator[Any]:
        for element in pipeline.iter(next(epochs)):
            yield _as_tf_structure(element)

    return tf.data.Dataset.from_generator(generate, output_signature=spec)


def _exact_spec(element: Any) -> Any:
    """Like :func:`element_spec`, with the element's actual shapes."""
    if isinstance(element, dict):
        return {key: _exact_spec(value) for key, value in element.items()}
    if isinstance(element, list) and element and all(isinstance(v, (str, bytes))
                                                     for v in element):
        return tf.TensorSpec([len(element)], tf.string)
    if isinstance(element, (list, tuple)):
        return tuple(_exact_spec(value) for value in element)
    spec = element_spec(element)
    if isinstance(element, (np.ndarray, np.generic)) and not isinstance(element, (str, bytes)):
        return tf.TensorSpec(list(np.shape(element)), spec.dtype)
    return spec


class _Mismatch(TypeError):
    """Two elements of a pipeline differ in dtype or rank."""


def _merge(a: tf.TensorSpec, b: tf.TensorSpec) -> tf.TensorSpec:
    if a.dtype != b.dtype or a.shape.rank != b.shape.rank:
        raise _Mismatch(f"the pipeline's elements change type or rank ({a} then {b}); "
                        "pass output_signature=")
    dims = [x if x == y else None for x, y in zip(a.shape.as_list(), b.shape.as_list(),
                                                   strict=True)]
    return tf.TensorSpec(dims, a.dtype)


def infer_signature(pipeline: Pipeline, probe: int = TF_PROBE) -> Any:
    """The ``output_signature`` of ``pipeline``, learned from a few elements run through
    its stages in this process with their buffers bypassed.

    The probe runs ``probe`` elements through the stages as they are, except that a
    ``shuffle``, ``skip`` or ``take`` passes elements straight on, a parallel ``map`` makes
    one call at a time, and a ``batch`` or ``bucket_by_length`` batches one element; one
    more run batches two. So it costs a few calls of each function, never a shuffle
    buffer's or a batch's worth. Dimensions that differ between the probed elements
    become None; a dimension that follows the batch size is the batch size times what it
    is per element when the pipeline's one batching stage is a ``batch`` with
    ``drop_remainder=True``, else None (the last batch is shorter).

    Code after a batch that needs the real batch size (a reshape to it, say) fails on the
    probe's batches of one: the signature is then learned from the first ``probe`` real
    elements instead, which fills the buffers before them, with a warning. Pass
    ``output_signature=`` to :func:`dataset` to avoid both.

    Raises:
        ValueError: the pipeline yields nothing.
        TypeError: elements change dtype or rank, or hold values tf.data cannot represent.
    """
    count = _check.integer("probe", probe, 1)
    try:
        return _bypassed_signature(pipeline, count)
    except _ProbeFailed as exc:
        warnings.warn(f"zloader.tf: the signature probe, with batches of one element, "
                      f"failed ({exc}); running {pipeline} until {count} full elements to "
                      "learn it instead. Pass output_signature= to skip that",
                      UserWarning, stacklevel=2)
    sample = _first(pipeline, count)
    if not sample:
        raise ValueError("cannot infer the signature of a pipeline that yields nothing; "
                         "pass output_signature=")
    spec = _merged([_exact_spec(_as_tf_structure(e)) for e in sample])
    if any(isinstance(s, (Batch, BucketByLength)) and not s.drop_remainder
           for s in pipeline.stages):
        spec = tf.nest.map_structure(
            lambda sp: tf.TensorSpec([None, *sp.shape.as_list()[1:]], sp.dtype)
            if sp.shape.rank else sp, spec)
    return spec


class _ProbeFailed(Exception):
    """The bypassed probe could not learn the signature (see :func:`infer_signature`)."""


def _bypassed_signature(pipeline: Pipeline, count: int) -> Any:
    """:func:`infer_signature`'s probe: runs with batches of one element, then of two."""
    batching = [s for s in pipeline.stages if isinstance(s, (Batch, BucketByLength))]
    try:
        ones = _first(_stand_in(pipeline, 1), count)
        twos = _first(_stand_in(pipeline, 2), 1) if batching else []
    except PipelineError as exc:
        raise _ProbeFailed(f"{exc.stage} raised {exc.exc_type}: {exc.message}") from exc
    if not ones and batching:  # a filter after the batch may refuse batches of one
        raise _ProbeFailed("it yielded nothing")
    if not ones:
        raise ValueError("cannot infer the signature of a pipeline that yields nothing; "
                         "pass output_signature=")
    one = _merged([_exact_spec(_as_tf_structure(e)) for e in ones])
    if not twos:
        return one
    two = _exact_spec(_as_tf_structure(twos[0]))
    known = (batching[0].batch_size if len(batching) == 1 and isinstance(
        batching[0], Batch) and batching[0].drop_remainder else None)
    try:
        return tf.nest.map_structure(lambda a, b: _batched(a, b, known), one, two)
    except (_Mismatch, ValueError) as exc:  # ValueError: the structures differ
        raise _ProbeFailed(f"batches of one and of two differ: {exc}") from exc


def _stand_in(pipeline: Pipeline, size: int) -> Pipeline:
    """``pipeline`` with its buffers bypassed and its batches of ``size`` elements."""
    stages: list[Stage] = []
    for stage in pipeline.stages:
        if isinstance(stage, (Shuffle, Skip, Take)):
            continue
        if isinstance(stage, Map) and stage.num_parallel_calls > 1:
            stage = dataclasses.replace(stage, num_parallel_calls=1)
        elif isinstance(stage, Batch):
            stage = dataclasses.replace(stage, batch_size=size, drop_remainder=False)
        elif isinstance(stage, BucketByLength):
            stage = dataclasses.replace(stage, batch_sizes=(size,) * len(stage.batch_sizes),
                                        drop_remainder=False)
        stages.append(stage)
    return Pipeline(pipeline.source, tuple(stages))


def _batched(one: tf.TensorSpec, two: tf.TensorSpec, batch_size: int | None
             ) -> tf.TensorSpec:
    """The spec of a leaf seen in batches of one (``one``) and of two (``two``): a
    dimension that doubles follows the batch size (``batch_size`` times its size in
    ``one`` when the batch size is fixed, else None); one that differs otherwise is None."""
    merged = _merge(one, two)
    if batch_size is None:
        return merged
    dims = [a * batch_size if a and b == 2 * a else m for a, b, m in zip(
        one.shape.as_list(), two.shape.as_list(), merged.shape.as_list(), strict=True)]
    return tf.TensorSpec(dims, one.dtype)


def _first(pipeline: Pipeline, count: int) -> list[Any]:
    """The first ``count`` elements of epoch 0, run in this process."""
    elements = pipeline.iter(0)
    try:
        return list(itertools.islice(elements, count))
    finally:
        close = getattr(elements, "close", None)
        if close is not None:
            close()


def _merged(specs: list[Any]) -> Any:
    """One spec over ``specs``: dimensions that differ become None."""
    spec = specs[0]
    for other in specs[1:]:
        spec = tf.nest.map_structure(_merge, spec, other)
    return spec


def _shape_guard(signature: Any) -> Callable[[Any, int], None] | None:
    """A check of each element against the dimensions an inferred ``signature`` fixed
    (None when it fixed none): an element that differs fails with a message naming the
    leaf and ``output_signature=``, where tf.data would fail with its own words."""
    fixed: list[tuple[tuple[Any, ...], tuple[int | None, ...]]] = []

    def walk(spec: Any, path: tuple[Any, ...]) -> None:
        if isinstance(spec, dict):
            for key, child in spec.items():
                walk(child, (*path, key))
        elif isinstance(spec, tuple):
            for at, child in enumerate(spec):
                walk(child, (*path, at))
        elif spec.shape.rank and any(d is not None for d in spec.shape.as_list()):
            fixed.append((path, tuple(spec.shape.as_list())))

    walk(signature, ())
    if not fixed:
        return None

    def guard(element: Any, index: int) -> None:
        for path, dims in fixed:
            leaf = element
            for step in path:
                leaf = leaf[step]
            shape = np.shape(leaf)
            if len(shape) != len(dims) or any(d is not None and d != n
                                              for d, n in zip(dims, shape, strict=True)):
                where = "".join(f"[{step!r}]" for step in path)
                raise ValueError(
                    f"element {index}{where} has shape {tuple(shape)}, but the signature "
                    f"inferred from the pipeline's first elements fixed it at "
                    f"{tuple(dims)} (None: any): pass output_signature= to "
                    "zloader.tf.dataset, with None for the dimensions that vary")
    return guard


def _checked(name: str, signature: Any) -> Any:
    """``signature`` if it is a ``tf.TypeSpec`` or a nest (dicts, tuples, lists) of them.

    Raises:
        TypeError: a leaf is something else (``"int64"``, a shape list...), named by its
            path under ``name``.
    """
    if isinstance(signature, dict):
        for key, value in signature.items():
            _checked(f"{name}[{key!r}]", value)
    elif isinstance(signature, (tuple, list)) and signature:
        for index, value in enumerate(signature):
            _checked(f"{name}[{index}]", value)
    elif not isinstance(signature, tf.TypeSpec):
        raise TypeError(f"{name} must be a tf.TensorSpec (or another tf.TypeSpec), or a "
                        f"dict or tuple of them; got {type(signature).__name__} "
                        f"{signature!r}")
    return signature


def dataset(pipeline: Pipeline, output_signature: Any = None, *, probe: int = TF_PROBE,
            **loader_kwargs: Any) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of the pipeline's elements, read from zloader workers.

    Args:
        pipeline: the pipeline.
        output_signature: the element signature, a ``tf.TensorSpec`` or a dict or tuple
            of them, as ``tf.data.Dataset.from_generator`` takes it; the pipeline then
            does not run in this process. When None it is inferred with
            :func:`infer_signature` (a few calls of each function in this process).
        probe: elements examined to infer the signature (default 2).
        **loader_kwargs: passed to :class:`zloader.Loader` (``num_workers``, ``broker``,
            ``sharding``...). The Loader starts on the first iteration and serves every
            epoch; it stops on :func:`close` (of this dataset or one derived from it) or
            when the process exits.

    Each iteration of the dataset is the next epoch of the Loader; it can be driven from
    any thread (as ``model.fit`` does), one epoch at a time.

    Raises:
        TypeError: ``pipeline`` is not a Pipeline, or ``output_signature`` holds something
            other than ``tf.TypeSpec`` s (the message names where).
    """
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"pipeline must be a zloader.Pipeline, got {type(pipeline).__name__}")
    guard = None
    if output_signature is not None:
        signature = _checked("output_signature", output_signature)
    else:
        signature = infer_signature(pipeline, probe)
        guard = _shape_guard(signature)
    source = _LoaderSource(pipeline, loader_kwargs, guard)
    result = tf.data.Dataset.from_generator(source.epoch, output_signature=signature)
    _SOURCES[result] = source
    return result


def close(ds: tf.data.Dataset) -> None:
    """Stop the Loaders (worker processes, shared memory) behind ``ds``: a dataset made by
    :func:`dataset`, or one made from such datasets by tf.data transformations that take
    them as inputs (``map``, ``batch``, ``prefetch``, ``zip``, ``with_options``...).
    Datasets only a function refers to (inside ``interleave`` or ``flat_map``) are not
    found: close those themselves. Iterating a closed dataset again starts a new Loader.

    TensorFlow keeps a reference to the dataset's generator, so garbage collection cannot
    be relied on to do this; loaders still open at interpreter exit are closed then.
    """
    for source in _sources_behind(ds):
        source.close()


def _sources_behind(ds: tf.data.Dataset) -> list[_LoaderSource]:
    """The sources of the :func:`dataset` datasets among ``ds`` and its inputs, walked
    through tf.data's ``_inputs()`` (each dataset records the datasets it reads)."""
    found: list[_LoaderSource] = []
    seen: set[int] = set()
    stack = [ds]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        source = _SOURCES.get(current)
        if source is not None:
            found.append(source)
            continue
        inputs = getattr(current, "_inputs", None)
        if callable(inputs):
            stack.extend(inputs())
    return found


# The dataset's own source (weakly: a dataset that goes leaves no entry), and every source
# with a Loader open, closed at exit.
_SOURCES: weakref.WeakKeyDictionary[tf.data.Dataset, _LoaderSource] = (
    weakref.WeakKeyDictionary())
_OPEN: set[_LoaderSource] = set()


@atexit.register
def _close_all() -> None:
    for source in list(_OPEN):
        source.close()


class _LoaderSource:
    """Owns the Loader behind a dataset; one generator call is one epoch."""

    def __init__(self, pipeline: Pipeline, loader_kwargs: dict[str, Any],
                 guard: Callable[[Any, int], None] | None = None) -> None:
        self.pipeline = pipeline
        self.loader_kwargs = loader_kwargs
        self.guard = guard  # checks each element against an inferred signature
        self.loader: Loader | None = None
        self.lock = threading.Lock()

    def epoch(self) -> Iterator[Any]:
        with self.lock:
            if self.loader is None:
                self.loader = Loader(self.pipeline, **self.loader_kwargs)
                _OPEN.add(self)
            loader = self.loader
        guard = self.guard
        for index, element in enumerate(loader):
            if guard is not None:
                guard(element, index)
            yield _as_tf_structure(element)

    def close(self) -> None:
        with self.lock:
            loader, self.loader = self.loader, None
            _OPEN.discard(self)
        if loader is not None:
            loader.close()
