"""A batch that failed, carried as a value: an error in a dataset's ``__getitem__`` (or
``__getitems__``, its iterator) or in ``collate_fn`` is one batch's failure, not the
epoch's, as in torch. The worker sends the failure in that batch's place as a few strings
(:func:`describe`); the consumer rebuilds the exception (:func:`rebuild`) and raises it when
that batch's turn comes, and the next ``next()`` goes on with the following batch.

The rebuilt exception is a :class:`zloader.PipelineError` whose message names the worker
and holds the original traceback (as torch's ``Caught KeyError in DataLoader worker
process 0. Original Traceback ...``), and which is also an instance of the original type
when the consumer has that type: a built-in one, or a class of a module it has imported
(the dataset's own ``class MyError(Exception)``). Nothing is unpickled: the type is looked
up by name among modules already imported, never imported on a worker's word.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import Any

from zloader._byfields import FrozenByFields
from zloader.errors import PipelineError, WorkerExited

FIELDS = 6
"""The strings of a failure: stage, type name, built-in base, message, traceback, where."""


@dataclass(eq=False, repr=False)
class Failed(FrozenByFields):
    """A batch's failure on the consumer's side, in that batch's place (not itself an
    exception, so that the queues and threads that carry batches carry it unchanged)."""

    error: BaseException


def describe(exc: BaseException, stage: str, where: str, at: str = "") -> tuple[str, ...]:
    """``exc``, raised by user code in ``stage`` (``"dataset"``, ``"collate_fn"``) at
    ``where`` (``"in DataLoader worker process 1"``), as the strings a record carries. Its
    context names the place in the input: the index a PipelineError of the dataset names,
    else ``at`` (``"indices [3, 7]"``: the batch's, for a failure in ``collate_fn``)."""
    wrapped = PipelineError.from_exception(exc, stage)
    context = " ".join(part for part in (wrapped.context or at, where) if part)
    return (wrapped.stage, wrapped.exc_type, wrapped.builtin, wrapped.message,
            wrapped.traceback, context)


def rebuild(fields: Any) -> Failed:
    """The :class:`Failed` of a failure's strings (as :func:`describe` made them).

    Raises:
        RuntimeError: ``fields`` are not such strings (a worker sent something else).
    """
    if not (isinstance(fields, (tuple, list)) and len(fields) == FIELDS
            and all(isinstance(f, str) for f in fields)):
        raise RuntimeError(f"a DataLoader worker sent a malformed failure: {fields!r:.80}")
    stage, exc_type, builtin, message, traceback, context = fields
    cls = _user_class(exc_type)
    if cls is None:
        return Failed(PipelineError.create(stage, exc_type, message, traceback, context,
                                           builtin=builtin))
    return Failed(cls(stage, exc_type, message, traceback, context))


_CLASSES: dict[str, type[PipelineError] | None] = {}


def _user_class(name: str) -> type[PipelineError] | None:
    """A PipelineError subclass that is also the exception class ``name``
    (``"module.Qual.Name"``) of a module this process has imported; None when there is no
    such class or the two cannot be combined (then the built-in base serves)."""
    if name in _CLASSES:
        return _CLASSES[name]
    found: Any = None
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        found = module
        for attr in parts[cut:]:
            found = getattr(found, attr, None)
        break
    made: type[PipelineError] | None = None
    if isinstance(found, type) and issubclass(found, Exception) \
            and not issubclass(found, PipelineError):
        try:
            made = type(f"PipelineError[{name}]", (PipelineError, found), {})
            made("probe", name, "")  # some layouts only fail on construction
            made.__module__ = __name__
        except TypeError:
            made = None
    _CLASSES[name] = made
    return made


def torch_words(exc: WorkerExited) -> str:
    """What torch's DataLoader says of its dead workers: how the first one it notices
    died (a signal, by its ``strsignal`` name, or an exit code)."""
    if not exc.pids or len(exc.codes) != len(exc.pids):
        return "DataLoader worker exited unexpectedly"
    pid, code = exc.pids[0], exc.codes[0]
    if code < 0:
        try:
            name = signal.strsignal(-code) or f"signal {-code}"
        except ValueError:
            name = f"signal {-code}"
        return f"DataLoader worker (pid {pid}) is killed by signal: {name}. "
    return f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {code}. "
