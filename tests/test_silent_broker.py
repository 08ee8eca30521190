"""A Loader whose broker does not answer says so while it waits, naming the address,
instead of staying silent for its whole timeout."""

from __future__ import annotations

import logging
import time

import pytest

from tests.service import free_port
from zloader import Loader, Pipeline, Timeout


@pytest.mark.slow  # (about 7-10 s; the suite keeps under 6 min on 2 cores)
def test_a_loader_with_nothing_at_its_broker_address_warns_while_it_waits(caplog):
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    caplog.set_level(logging.WARNING, logger="zloader")
    start = time.monotonic()
    with Loader(Pipeline.range(5), broker=address, timeout=6.5) as loader:
        with pytest.raises(Timeout):
            list(loader)
    assert time.monotonic() - start < 30
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "no answer from a broker" in r.getMessage()]
    assert warnings, "no warning while the Loader waited for a broker that is not there"
    assert address in warnings[0] and "timeout=6.5" in warnings[0]
