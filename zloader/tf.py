"""TensorFlow adapter: a ``tf.data.Dataset`` over a zloader Pipeline.

This module is the only one in zloader that imports tensorflow; import it explicitly
(``import zloader.tf``). In this version the pipeline runs in the iterating process,
through ``tf.data.Dataset.from_generator``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from zloader import _check
from zloader.pipeline import Pipeline

__all__ = ["element_spec", "to_dataset"]


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
