"""zloader's exception hierarchy, rooted at :class:`ZloaderError`.

Errors that wrap a failure of another kind also inherit that kind's built-in type, so
code written for the plain exception keeps working: ``Timeout`` is a ``TimeoutError``
(and a ``RuntimeError``, as torch's DataLoader timeout),
``CodecError`` a ``ValueError``, and a ``PipelineError`` raised because user code raised
``KeyError`` is also a ``KeyError``.

Errors cross process boundaries as plain values (stage name, exception type name,
message, traceback text), never as pickles; :meth:`PipelineError.create` rebuilds one
from those values on the consumer side.
"""

from __future__ import annotations

import builtins
import threading
import traceback as _traceback
from typing import Any

__all__ = [
    "CodecError",
    "FingerprintWarning",
    "PipelineError",
    "SerializationError",
    "Timeout",
    "ZloaderError",
    "passes_through",
]


class ZloaderError(Exception):
    """Base class of every error zloader raises on its own account."""


class CodecError(ZloaderError, ValueError):
    """An element could not be encoded, or received bytes are not a valid element."""


class Timeout(ZloaderError, TimeoutError, RuntimeError):
    """An operation did not finish within its deadline (also a ``RuntimeError``, which
    torch's DataLoader raises when a batch takes longer than its ``timeout``)."""


class WorkerExited(ZloaderError, RuntimeError):
    """A worker process the Loader started died, and the epoch cannot complete without it
    (its job's splits are pinned to its worker index, or no worker is left).

    Attributes:
        pids: the dead workers' process ids.
        codes: how each ended, as ``Popen.returncode`` says (``-N``: killed by signal N).
    """

    def __init__(self, message: str, pids: tuple[int, ...] = (),
                 codes: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.pids = pids
        self.codes = codes

    def __reduce__(self) -> tuple[Any, ...]:
        # crosses processes (a Queue, Ray) whole
        return type(self), (str(self), self.pids, self.codes)


class SerializationError(ZloaderError, TypeError):
    """A pipeline cannot be pickled for its workers; the message names the stage and the
    value it holds that cannot be pickled."""


class FingerprintWarning(UserWarning):
    """Part of a pipeline could not be fingerprinted soundly; the pipeline will not be shared."""


class MixWindowWarning(UserWarning):
    """A Loader's mix is drawn on each worker, not where the streams meet: with several
    workers its weights hold in every window only while each worker has splits of every
    input, and a ``"first_exhausted"`` mix ends on each worker apart (docs/semantics.md,
    "Mixing")."""


class PipelineError(ZloaderError):
    """User code in a pipeline stage raised.

    Attributes:
        stage: name of the stage whose code raised (``"map(decode)"``, ``"from_files"``).
        exc_type: name of the original exception's type (``"KeyError"``,
            ``"mypackage.MyError"``).
        builtin: name of the built-in exception type this error also inherits, or ``""``.
        message: ``str()`` of the original exception.
        traceback: the original traceback as text (from the process where it happened).
        context: where in the input it happened (``"index 17"``, ``"file a.txt"``), or ``""``.

    Instances made by :meth:`create` are also instances of the original exception's
    nearest built-in type, so ``except KeyError:`` still catches a failing lookup.
    """

    stage: str
    exc_type: str
    builtin: str
    message: str
    traceback: str
    context: str

    def __init__(
        self,
        stage: str,
        exc_type: str,
        message: str,
        traceback: str = "",
        context: str = "",
    ) -> None:
        # Deliberately not calling the built-in base's __init__: some (UnicodeDecodeError)
        # need arguments we do not have. BaseException.__new__ already stored args.
        Exception.__init__(self, stage, exc_type, message, traceback, context)
        self.stage = stage
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback
        self.context = context
        self.builtin = _nearest_builtin_name(type(self)) or ""

    def __str__(self) -> str:
        where = f" at {self.context}" if self.context else ""
        text = f"stage {self.stage!r} raised {self.exc_type}{where}: {self.message}"
        if self.traceback:
            text += "\n\nOriginal traceback:\n" + self.traceback.rstrip("\n")
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            PipelineError.create,
            (self.stage, self.exc_type, self.message, self.traceback, self.context,
             self.builtin),
        )

    @staticmethod
    def create(
        stage: str,
        exc_type: str,
        message: str,
        traceback: str = "",
        context: str = "",
        builtin: str | None = None,
    ) -> PipelineError:
        """Build a PipelineError that is also an instance of a built-in exception type.

        Args:
            stage: name of the failing stage.
            exc_type: name of the original exception's type.
            message: the original exception's message.
            traceback: the original traceback text.
            context: where in the input the failure happened, or ``""``.
            builtin: name of the built-in type to inherit (``"KeyError"``); defaults to
                ``exc_type``. Names that are not built-in exceptions give a plain PipelineError.

        Returns:
            The error, ready to raise.
        """
        cls = _pipeline_error_class(exc_type if builtin is None else builtin)
        return cls(stage, exc_type, message, traceback, context)

    @staticmethod
    def from_exception(exc: BaseException, stage: str, context: str = "") -> PipelineError:
        """Wrap an exception raised by user code in ``stage``.

        The result inherits the nearest built-in type in ``type(exc)``'s MRO, so a user
        ``class MyError(ValueError)`` arrives as a ``PipelineError`` that is a ``ValueError``.
        """
        if isinstance(exc, PipelineError):
            return exc
        text = "".join(_traceback.format_exception(type(exc), exc, exc.__traceback__))
        cls = type(exc)
        if getattr(builtins, cls.__name__, None) is cls:
            name = cls.__name__
        else:
            name = f"{cls.__module__}.{cls.__qualname__}"
        return PipelineError.create(stage, name, str(exc), text, context,
                                    builtin=_nearest_builtin_name(cls) or "")


def passes_through(exc: BaseException) -> bool:
    """Whether ``exc``, raised while user code ran in this thread, must propagate as it is
    instead of becoming the stage's :class:`PipelineError`.

    Only a ``KeyboardInterrupt`` on the main thread does: it may be the user's Ctrl-C,
    which Python delivers to whatever code the main thread is running. Everything else
    user code raises, ``SystemExit`` and ``GeneratorExit`` included, is the stage's failure:
    in a worker's thread it would otherwise end the thread silently and leave the consumer
    waiting.
    """
    return (isinstance(exc, KeyboardInterrupt)
            and threading.current_thread() is threading.main_thread())


_CLASSES: dict[str, type[PipelineError]] = {}

# Built-ins that must never become a base: catching them means something else entirely.
_NOT_BASES = {"BaseException", "Exception", "GeneratorExit", "KeyboardInterrupt", "SystemExit",
              "StopIteration", "StopAsyncIteration"}


def _nearest_builtin_name(cls: type[BaseException]) -> str | None:
    for base in cls.__mro__:
        if (issubclass(base, BaseException) and base.__name__ not in _NOT_BASES
                and getattr(builtins, base.__name__, None) is base):
            return base.__name__
    return None


def _pipeline_error_class(exc_type: str) -> type[PipelineError]:
    """The PipelineError subclass that also derives from built-in ``exc_type`` (cached)."""
    cls = _CLASSES.get(exc_type)
    if cls is not None:
        return cls
    base = getattr(builtins, exc_type, None)
    candidates: list[type[BaseException]] = []
    if isinstance(base, type) and issubclass(base, BaseException):
        candidates = [b for b in base.__mro__ if b.__name__ not in _NOT_BASES
                      and issubclass(b, Exception)]
    cls = PipelineError
    for candidate in candidates:
        try:
            made = type(f"PipelineError[{candidate.__name__}]", (PipelineError, candidate), {})
            made("probe", candidate.__name__, "")  # some layouts only fail on construction
        except TypeError:
            continue
        made.__module__ = __name__
        cls = made
        break
    _CLASSES[exc_type] = cls
    return cls
