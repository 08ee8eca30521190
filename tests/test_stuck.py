"""A worker that heartbeats but produces nothing is caught by the Loader's ``timeout``;
``timeout`` itself must be a real bound (docs/reliability.md)."""

from __future__ import annotations

import math

import pytest

from zloader import Loader, Pipeline


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, -1.0])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused(timeout):
    with pytest.raises(ValueError, match="timeout"):
        Loader(Pipeline.range(4), num_workers=1, timeout=timeout)
    torch = pytest.importorskip("torch")
    from zloader.torch import DataLoader

    with pytest.raises(ValueError, match="timeout"):  # torch's 0 (no limit) stays allowed
        DataLoader(torch.arange(4), num_workers=1, timeout=timeout)
    DataLoader(torch.arange(4), num_workers=1, timeout=0)
