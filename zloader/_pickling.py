"""Pickling a pipeline for its workers: cloudpickle, keeping the user's file names.

cloudpickle (3.0 and later) writes every code object it pickles by value with the file
name ``<dynamic-code>``, to make its output independent of where code was defined. Our
pipelines' functions travel by value (``__main__``, lambdas, the user's own modules), so a
traceback from a worker would name no file at all. zloader never compares pickles (jobs
are identified by fingerprint), so :func:`dumps_pipeline` keeps each code object's real
``co_filename``: a worker's traceback then names the user's file and line, and shows the
line's text where the file exists on the worker's host.
"""

from __future__ import annotations

import io
import pickle
import types
from collections import ChainMap
from typing import Any

import cloudpickle
from cloudpickle import cloudpickle as _cloudpickle_impl

__all__ = ["dumps_pipeline"]

# cloudpickle's reducer for code objects; older versions (< 3.0, which keep file names)
# have it elsewhere, and then nothing needs fixing.
_code_reduce = getattr(_cloudpickle_impl, "_code_reduce", None)


def _code_with_filename(make: Any, args: tuple[Any, ...], filename: str) -> types.CodeType:
    """Rebuild a code object the way cloudpickle does, then give it back its file name.
    Runs on the worker when the pipeline is unpickled."""
    code: types.CodeType = make(*args)
    return code.replace(co_filename=filename)


def _reduce_code(code: types.CodeType) -> tuple[Any, ...]:
    make, args = _code_reduce(code)  # type: ignore[misc]
    return _code_with_filename, (make, args, code.co_filename)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, keeping code objects' file names."""

    if _code_reduce is not None:
        dispatch_table = ChainMap({types.CodeType: _reduce_code},
                                  cloudpickle.Pickler.dispatch_table)


def dumps_pipeline(pipeline: Any) -> bytes:
    """cloudpickle ``pipeline`` (with whatever modules the caller registered to travel by
    value), keeping the file names of the code it carries.

    Args:
        pipeline: the :class:`~zloader.pipeline.Pipeline` to send to workers.

    Returns:
        The pickle, for ``cloudpickle.loads`` on a worker.
    """
    with io.BytesIO() as buffer:
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(pipeline)
        return buffer.getvalue()
