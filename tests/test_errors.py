"""The error hierarchy: PipelineError keeps the original built-in type, crosses processes
as values, and reads well."""

from __future__ import annotations

import pickle

import pytest

from zloader import CodecError, PipelineError, Timeout, ZloaderError


def raise_in(exc: BaseException) -> PipelineError:
    try:
        raise exc
    except Exception as caught:
        return PipelineError.from_exception(caught, "map(f)", "index 3")


def test_hierarchy():
    assert issubclass(CodecError, ZloaderError) and issubclass(CodecError, ValueError)
    assert issubclass(Timeout, ZloaderError) and issubclass(Timeout, TimeoutError)
    assert issubclass(PipelineError, ZloaderError)


@pytest.mark.parametrize("exc, builtin", [
    (KeyError("k"), KeyError),
    (ValueError("v"), ValueError),
    (ZeroDivisionError("z"), ArithmeticError),
    (FileNotFoundError(2, "missing"), OSError),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), UnicodeError),
    (IndexError("i"), LookupError),
])
def test_pipeline_error_is_also_the_original_builtin_type(exc, builtin):
    error = raise_in(exc)
    assert isinstance(error, PipelineError) and isinstance(error, builtin)
    assert isinstance(error, type(exc)) or type(exc) is UnicodeDecodeError
    assert error.stage == "map(f)" and error.context == "index 3"
    assert type(exc).__name__ in error.traceback
    with pytest.raises(builtin):
        raise error


def test_user_exception_subclass_keeps_its_builtin_base_and_its_name():
    class ShapeError(ValueError):
        pass

    error = raise_in(ShapeError("bad shape"))
    assert isinstance(error, ValueError)
    assert error.exc_type.endswith("ShapeError") and error.builtin == "ValueError"
    assert "ShapeError at index 3: bad shape" in str(error)


def test_exception_without_builtin_base_is_a_plain_pipeline_error():
    class Odd(Exception):
        pass

    error = raise_in(Odd("odd"))
    assert type(error) is PipelineError and error.builtin == ""


def test_created_from_values_as_another_process_would():
    error = PipelineError.create("decode", "KeyError", "'label'", "Traceback ...\nKeyError")
    assert isinstance(error, KeyError)
    text = str(error)
    assert text.startswith("stage 'decode' raised KeyError: 'label'")
    assert "Original traceback:\nTraceback ...\nKeyError" in text
    assert type(PipelineError.create("s", "NoSuchError", "m")) is PipelineError
    assert type(PipelineError.create("s", "SystemExit", "m")) is PipelineError


def test_round_trips_through_pickle_for_users_who_pickle_errors():
    error = raise_in(KeyError("k"))
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, KeyError) and isinstance(copy, PipelineError)
    assert (copy.stage, copy.exc_type, copy.message, copy.traceback, copy.context) == (
        error.stage, error.exc_type, error.message, error.traceback, error.context)


def _every_zloader_error() -> set[type]:
    import importlib
    import pkgutil

    import zloader

    for module in pkgutil.walk_packages(zloader.__path__, "zloader."):
        if not module.name.startswith(("zloader.torch", "zloader.tf", "zloader.ray")) \
                and not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    found, todo = set(), [ZloaderError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        if cls is not PipelineError:  # its per-builtin subclasses are tested above
            todo += cls.__subclasses__()
    return found


def test_every_zloader_error_round_trips_through_pickle_whole():
    """torch's tests (and users) send the errors a loader raises through a
    multiprocessing Queue, and Ray sends them between processes: each must come back as
    the same type with the same message and attributes."""
    from zloader import WorkerExited
    from zloader.broker.journal import JournalVersionError, WorkDirError
    from zloader.cachefile import BadEntry, CacheWriteError
    from zloader.errors import SerializationError
    from zloader.formats.tfrecord import CorruptRecord
    from zloader.formats.webdataset import CorruptShard
    from zloader.storage import StorageError
    from zloader.transport.protocol import ProtocolError, VersionMismatch
    from zloader.transport.ring import RingError
    from zloader.transport.shm import ShmError
    from zloader.worker.broker_link import BrokerRefused, BrokerUnread

    samples = [ZloaderError("z"), CodecError("c"), Timeout("t"),
               WorkerExited("worker pid 7 exited", (7, 8), (-9, 1)), SerializationError("s"),
               raise_in(KeyError("k")), StorageError("s3://b/k: gone"), BrokerRefused("no"),
               BrokerUnread("full"),
               CorruptRecord("crc"), CorruptShard("shard.tar: cut"), ProtocolError("p"),
               VersionMismatch(b"ZLP/2"),
               RingError("r"), ShmError("m"), WorkDirError("w"), JournalVersionError("v"),
               BadEntry("short entry"), CacheWriteError("no codec for a set")]
    classes = {type(e) for e in samples} | {PipelineError}
    assert _every_zloader_error() <= classes, "a zloader error has no sample here"
    for error in samples:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
        assert vars(copy) == vars(error)


def test_wrapping_a_pipeline_error_returns_it_unchanged():
    inner = raise_in(KeyError("k"))
    assert PipelineError.from_exception(inner, "outer") is inner
