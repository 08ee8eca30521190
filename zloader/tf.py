"""TensorFlow adapters: ``tf.data.Dataset`` s over a zloader Pipeline.

This module is the only one in zloader that imports tensorflow; import it explicitly
(``import zloader.tf``). :func:`dataset` reads the pipeline through a zloader
:class:`~zloader.Loader` (worker processes); :func:`to_dataset` runs it in the iterating
process. Both are built on ``tf.data.Dataset.from_generator``; each iteration of the
returned dataset is one epoch, so ``model.fit(ds, epochs=N)`` works.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from zloader import _check
from zloader._defaults import TF_PROBE
from zloader.loader import Loader
from zloader.pipeline import Pipeline
from zloader.stages import Batch

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
        spec: the ``output_signature``; by default it is inferred from the first element
            (which runs the pipeline once up to that element) with every dimension unknown.
            Pass one to keep static shapes.
        epoch: the epoch of the first iteration; each later iteration runs the next one.

    Raises:
        TypeError: ``pipeline`` is not a Pipeline, or its elements cannot be tf tensors.
        ValueError: ``spec`` is None and the pipeline yields nothing to infer it from.
    """
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"pipeline must be a zloader.Pipeline, got {type(pipeline).__name__}")
    epochs = itertools.count(_check.integer("epoch", epoch, 0))
    if spec is None:
        elements = pipeline.iter(0)
        try:
            first = next(elements, _EMPTY)
        finally:
            close = getattr(elements, "close", None)
            if close is not None:
                close()
        if first is _EMPTY:
            raise ValueError("cannot infer the element spec of a pipeline that yields "
                             "nothing; pass spec=")
        spec = element_spec(first)

    def generate() -> Iterator[Any]:
        for element in pipeline.iter(next(epochs)):
            yield _as_tf_structure(element)

    return tf.data.Dataset.from_generator(generate, output_signature=spec)


_EMPTY = object()


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


def _merge(a: tf.TensorSpec, b: tf.TensorSpec) -> tf.TensorSpec:
    if a.dtype != b.dtype or a.shape.rank != b.shape.rank:
        raise TypeError(f"the pipeline's elements change type or rank ({a} then {b}); "
                        "pass output_signature=")
    dims = [x if x == y else None for x, y in zip(a.shape.as_list(), b.shape.as_list(),
                                                   strict=True)]
    return tf.TensorSpec(dims, a.dtype)


def infer_signature(pipeline: Pipeline, probe: int = TF_PROBE) -> Any:
    """The ``output_signature`` of ``pipeline``, from its first ``probe`` elements.

    Dimensions that differ between those elements become None, and so does the leading
    dimension when a ``batch`` stage keeps its remainder (the last batch is shorter). The cost:
    the pipeline runs in this process until it has produced ``probe`` elements.

    Raises:
        ValueError: the pipeline yields nothing.
        TypeError: elements change dtype or rank, or hold values tf.data cannot represent.
    """
    elements = pipeline.iter(0)
    try:
        sample = [e for _, e in zip(range(_check.integer("probe", probe, 1)), elements,
                                    strict=False)]
    finally:
        close = getattr(elements, "close", None)
        if close is not None:
            close()
    if not sample:
        raise ValueError("cannot infer the signature of a pipeline that yields nothing; "
                         "pass output_signature=")
    spec = _exact_spec(_as_tf_structure(sample[0]))
    for element in sample[1:]:
        spec = tf.nest.map_structure(_merge, spec, _exact_spec(_as_tf_structure(element)))
    if any(isinstance(s, Batch) and not s.drop_remainder for s in pipeline.stages):
        spec = tf.nest.map_structure(
            lambda sp: tf.TensorSpec([None, *sp.shape.as_list()[1:]], sp.dtype)
            if sp.shape.rank else sp, spec)
    return spec


def dataset(pipeline: Pipeline, output_signature: Any = None, *, probe: int = TF_PROBE,
            **loader_kwargs: Any) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of the pipeline's elements, read from zloader workers.

    Args:
        pipeline: the pipeline.
        output_signature: the element signature; inferred with :func:`infer_signature`
            when None.
        probe: elements examined to infer the signature (default 2).
        **loader_kwargs: passed to :class:`zloader.Loader` (``num_workers``, ``broker``,
            ``sharding``...). The Loader starts on the first iteration and serves every
            epoch; it stops on :func:`close` (of this dataset or one derived from it) or
            when the process exits.

    Each iteration of the dataset is the next epoch of the Loader; it can be driven from
    any thread (as ``model.fit`` does), one epoch at a time.
    """
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"pipeline must be a zloader.Pipeline, got {type(pipeline).__name__}")
    signature = output_signature if output_signature is not None else infer_signature(
        pipeline, probe)
    source = _LoaderSource(pipeline, loader_kwargs)
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

    def __init__(self, pipeline: Pipeline, loader_kwargs: dict[str, Any]) -> None:
        self.pipeline = pipeline
        self.loader_kwargs = loader_kwargs
        self.loader: Loader | None = None
        self.lock = threading.Lock()

    def epoch(self) -> Iterator[Any]:
        with self.lock:
            if self.loader is None:
                self.loader = Loader(self.pipeline, **self.loader_kwargs)
                _OPEN.add(self)
            loader = self.loader
        for element in loader:
            yield _as_tf_structure(element)

    def close(self) -> None:
        with self.lock:
            loader, self.loader = self.loader, None
            _OPEN.discard(self)
        if loader is not None:
            loader.close()
