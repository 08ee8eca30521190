"""The drop-in cuts torch's own shuffled and sequential batch samplers into index arrays
without a Python int per index (zloader/torch/feed.py ``batches_of``): the same batches
as torch's sampler, drawn from the same generators at the same pulls, so that every
later draw (the next epoch's seed, the user's own) is what it is under torch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.utils.data

import zloader.torch as zt
from zloader.torch import permutation
from zloader.torch.feed import batches_of


class Sized(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def states(generator: torch.Generator | None) -> tuple[bytes, bytes | None]:
    own = generator.get_state().numpy().tobytes() if generator is not None else None
    return torch.get_rng_state().numpy().tobytes(), own


def pulled(iterator: object, pulls: int) -> list[list[int]]:
    """``pulls`` pulls of ``iterator`` (fewer if it ends), each batch as a list."""
    return [np.asarray(batch).tolist() for batch in itertools.islice(iterator, pulls)]


@pytest.mark.parametrize("size, batch", [(1000, 64), (1024, 64), (7, 10), (64, 64), (1, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("kind", ["shuffled", "shuffled, own generator", "sequential"])
@pytest.mark.parametrize("ahead", [None, 100])
def test_the_batches_and_every_draw_are_torch_s_at_every_pull(size, batch, drop_last,
                                                                kind, ahead,
                                                                monkeypatch) -> None:
    if ahead is not None:  # (shuffles of 2 on start emulated for ``ahead``: permutation.py)
        monkeypatch.setattr(permutation, "PERMUTATION_MIN_SAMPLES", 2)
        monkeypatch.setattr(permutation, "PERMUTATION_AHEAD", ahead)
    def sampler() -> tuple[torch.utils.data.BatchSampler, torch.Generator | None]:
        generator = None
        if kind == "sequential":
            inner: torch.utils.data.Sampler = torch.utils.data.SequentialSampler(Sized(size))
        else:
            if kind == "shuffled, own generator":
                generator = torch.Generator()
                generator.manual_seed(5)
            inner = torch.utils.data.RandomSampler(Sized(size), generator=generator)
        return torch.utils.data.BatchSampler(inner, batch, drop_last), generator

    whole = -(-size // batch)
    for pulls in sorted({0, 1, whole - 1, whole, whole + 1, whole + 2}):
        torch.manual_seed(11)
        theirs, generator = sampler()
        want = pulled(iter(theirs), pulls)
        want_states = states(generator)
        torch.manual_seed(11)
        ours, generator = sampler()
        cut = batches_of(ours)
        assert getattr(cut, "__name__", None) == "_cut"  # (the fast path was taken)
        assert pulled(cut, pulls) == want, pulls
        permutation.settle()  # (a large shuffle's generator moves on there: DataLoader's iter)
        assert states(generator) == want_states, pulls


def test_samplers_it_does_not_know_are_iterated_as_they_are() -> None:
    data = Sized(100)
    weighted = torch.utils.data.BatchSampler(
        torch.utils.data.WeightedRandomSampler([1.0] * 100, 100), 10, False)
    replaced = torch.utils.data.BatchSampler(
        torch.utils.data.RandomSampler(data, replacement=True), 10, False)
    counted = torch.utils.data.BatchSampler(
        torch.utils.data.RandomSampler(data, num_samples=30), 10, False)

    class Mine(torch.utils.data.BatchSampler):
        pass

    subclass = Mine(torch.utils.data.SequentialSampler(data), 10, False)
    for sampler in (weighted, replaced, counted, subclass):
        torch.manual_seed(3)
        want = [list(b) for b in sampler]
        torch.manual_seed(3)
        got = list(batches_of(sampler))
        assert got == want and all(isinstance(b, list) for b in got)


def test_the_drop_in_s_shuffled_epochs_are_torch_s_batch_for_batch() -> None:
    data = Sized(1000)
    generator = torch.Generator()
    generator.manual_seed(9)
    theirs = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True,
                                         generator=generator)
    want = [[b.tolist() for b in theirs] for _ in range(2)]
    generator.manual_seed(9)
    ours = zt.DataLoader(data, batch_size=64, shuffle=True, generator=generator,
                         num_workers=2)
    assert [[b.tolist() for b in ours] for _ in range(2)] == want
