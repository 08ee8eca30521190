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


def test_a_timeout_after_the_loaders_own_worker_died_says_which_and_how():
    import os
    import signal
    import time

    from zloader import Timeout

    def slow(x):
        time.sleep(0.05)
        return x

    with Loader(Pipeline.range(1000).map(slow), num_workers=1, timeout=3) as loader:
        elements = iter(loader)
        next(elements)
        pid = loader._processes[0].pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(Timeout) as info:
            for _ in elements:
                pass
    assert f"worker pid {pid} was killed by SIGKILL" in str(info.value)
