"""Arguments are checked where they are given: a bad one raises in the constructor, naming
itself, before any process, thread or socket starts (nothing to clean up, nothing that
fails seconds later in a background thread)."""

from __future__ import annotations

import itertools

import pytest

from zloader import Loader, Pipeline

PIPELINE = Pipeline.range(10)


@pytest.mark.parametrize("kwargs, name", [
    ({"broker": "tcp://127.0.0.1"}, "broker"),            # no port
    ({"broker": "tcp://127.0.0.1:0"}, "broker"),
    ({"broker": "tcp://127.0.0.1:70000"}, "broker"),
    ({"broker": "127.0.0.1:5555"}, "broker"),             # no scheme
    ({"broker": "udp://127.0.0.1:5555"}, "broker"),
    ({"ring_bytes": 100}, "ring_bytes"),                  # not a multiple of 64
    ({"ring_bytes": 0}, "ring_bytes"),
    ({"ring_bytes": "64M"}, "ring_bytes"),
    ({"job_name": "x" * 2_000_000, "broker": "tcp://127.0.0.1:5555"}, "job_name"),
    ({"keys": "/nonexistent/keys"}, "keys"),              # embedded mode validates it too
    ({"timeout": float("nan")}, "timeout"),
])
def test_a_bad_argument_raises_in_the_constructor_naming_it(kwargs, name):
    with pytest.raises((ValueError, TypeError, OSError)) as info:
        Loader(PIPELINE, num_workers=1, **kwargs)
    assert name in str(info.value) or (name == "keys" and "nonexistent" in str(info.value))


def test_a_new_iterator_ends_the_previous_one_instead_of_both_hanging():
    with Loader(Pipeline.range(200), num_workers=2, timeout=30) as loader:
        first = iter(loader)
        assert next(first) in range(200)
        second = iter(loader)
        assert sorted(second) == list(range(200))  # the whole of the next epoch
        with pytest.raises(RuntimeError, match="one iterator at a time"):
            list(itertools.islice(first, 500))
        assert sorted(loader) == list(range(200))


def test_a_loader_whose_only_worker_died_says_which_and_how():
    """Not after the timeout: as soon as the data it sent is in (WorkerExited; it was a
    Timeout after 3 s before the Loader watched its own workers)."""
    import os
    import signal
    import time

    from zloader import WorkerExited

    def slow(x):
        time.sleep(0.05)
        return x

    with Loader(Pipeline.range(1000).map(slow), num_workers=1, timeout=3) as loader:
        elements = iter(loader)
        next(elements)
        pid = loader._processes[0].pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerExited) as info:
            for _ in elements:
                pass
    assert f"worker pid {pid} was killed by SIGKILL" in str(info.value)


class _Opaque:
    """A value the codec has no node for."""

    def __init__(self, value: int) -> None:
        self.value = value


def _opaque(x: int) -> tuple[int, _Opaque]:
    return x, _Opaque(x)


def test_objects_true_carries_values_the_codec_does_not_know_from_the_loaders_own_workers():
    with Loader(Pipeline.range(40).map(_opaque), num_workers=2, objects=True,
                timeout=30) as loader:
        got = sorted((x, o.value, type(o).__name__) for x, o in loader)
    assert got == [(x, x, "_Opaque") for x in range(40)]


def test_without_objects_such_a_value_is_a_pipeline_error_naming_it():
    from zloader import PipelineError

    with Loader(Pipeline.range(4).map(_opaque), num_workers=1, timeout=30) as loader, \
            pytest.raises(PipelineError, match="_Opaque is not supported"):
        list(loader)


def test_objects_true_needs_embedded_mode():
    with pytest.raises(ValueError, match="objects=True needs embedded mode"):
        Loader(Pipeline.range(4), broker="tcp://127.0.0.1:9", objects=True)
