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

import dataclasses
import functools
import io
import pickle
import types
from collections import ChainMap
from collections.abc import Iterator
from typing import Any

import cloudpickle
from cloudpickle import cloudpickle as _cloudpickle_impl

from zloader._defaults import MAX_SEARCH_DEPTH
from zloader.errors import SerializationError
from zloader.fingerprint import global_names

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


def _dumps(value: Any) -> bytes:
    with io.BytesIO() as buffer:
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        return buffer.getvalue()


def dumps_pipeline(pipeline: Any) -> bytes:
    """cloudpickle ``pipeline`` (with whatever modules the caller registered to travel by
    value), keeping the file names of the code it carries.

    Args:
        pipeline: the :class:`~zloader.pipeline.Pipeline` to send to workers.

    Returns:
        The pickle, for ``cloudpickle.loads`` on a worker.

    Raises:
        SerializationError: part of the pipeline cannot be pickled; the message names the
            source or stage (kind, name and position) and the value it holds (how it is
            reached: closure variable, global, default, attribute..., and its type).
    """
    try:
        return _dumps(pipeline)
    except Exception as exc:  # pickling runs user __reduce__ code: anything may come out
        raise _explain(pipeline, exc) from exc


# --- naming what cannot be pickled -------------------------------------------------------


def _explain(pipeline: Any, error: Exception) -> SerializationError:
    """The error naming the part of ``pipeline`` that cannot be pickled, and what in it."""
    parts = [(f"source {pipeline.source.name!r} ({pipeline.source.kind})", pipeline.source)]
    parts += [(f"stage {index} {stage.name!r} ({stage.kind})", stage)
              for index, stage in enumerate(pipeline.stages, 1)]
    for label, part in parts:
        found = _culprit(part, [], set(), 0)
        if found is None:
            continue
        path, value, exc = found
        kind = type(value)
        holds = (f"{' > '.join(path)}: a {kind.__module__}.{kind.__qualname__}" if path
                 else f"a {kind.__module__}.{kind.__qualname__}")
        return SerializationError(
            f"the pipeline cannot be pickled for its workers: {label} holds {holds}, which "
            f"cannot be pickled ({type(exc).__name__}: {exc}). Create such a value inside "
            "the function, on the worker (once, e.g. in a global set on first use), instead "
            "of capturing it; or give its class a __reduce__ that rebuilds it from settings")
    return SerializationError(f"the pipeline cannot be pickled for its workers "
                              f"({type(error).__name__}: {error})")


def _pickle_error(value: Any) -> Exception | None:
    try:
        _dumps(value)
    except Exception as exc:
        return exc
    return None


def _culprit(value: Any, path: list[str], seen: set[int],
             depth: int) -> tuple[list[str], Any, Exception] | None:
    """The innermost value reachable from ``value`` that does not pickle, with the path
    to it and its error; None when ``value`` pickles."""
    exc = _pickle_error(value)
    if exc is None:
        return None
    if depth < MAX_SEARCH_DEPTH and id(value) not in seen:
        seen.add(id(value))
        for step, child in _references(value):
            found = _culprit(child, [*path, step], seen, depth + 1)
            if found is not None:
                return found
    return path, value, exc


def _references(value: Any) -> Iterator[tuple[str, Any]]:
    """What ``value`` holds that pickling it pickles too, each with its name."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for spec in dataclasses.fields(value):
            field = getattr(value, spec.name)
            named = getattr(field, "__qualname__", None)
            yield (f"{spec.name} {named}" if isinstance(named, str) else spec.name), field
    elif isinstance(value, types.FunctionType):
        yield from _function_references(value)
    elif isinstance(value, functools.partial):
        yield f"partial of {getattr(value.func, '__qualname__', 'a callable')}", value.func
        yield from ((f"partial argument {i}", a) for i, a in enumerate(value.args))
        yield from ((f"partial argument {k!r}", a) for k, a in value.keywords.items())
    elif isinstance(value, types.MethodType):
        yield f"method {value.__func__.__qualname__}", value.__func__
        yield "its object", value.__self__
    elif isinstance(value, dict):
        yield from ((f"item {k!r}", v) for k, v in value.items())
    elif isinstance(value, (list, tuple, set, frozenset)):
        yield from ((f"item {i}", v) for i, v in enumerate(value))
    else:
        state = getattr(value, "__dict__", None)
        if isinstance(state, dict):
            yield from ((f"attribute {k!r}", v) for k, v in state.items())


def _function_references(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
        try:
            yield f"closure variable {name!r}", cell.cell_contents
        except ValueError:  # an empty cell
            continue
    defaults = fn.__defaults__ or ()
    names = code.co_varnames[code.co_argcount - len(defaults):code.co_argcount]
    for name, default in zip(names, defaults, strict=True):
        yield f"default {name!r}", default
    for name, default in (fn.__kwdefaults__ or {}).items():
        yield f"default {name!r}", default
    for name in sorted(global_names(code)):
        if name in fn.__globals__:
            yield f"global {name!r}", fn.__globals__[name]
