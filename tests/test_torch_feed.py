"""A map-style epoch sampled as torch samples it (zloader/torch/feed.py): the sampler is
pulled ``prefetch_factor * num_workers`` times at ``iter()`` and once per batch yielded,
never the whole epoch up front, and each batch's indices go to its worker as it is
handed out."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

import zloader.torch as zt
from zloader.torch.feed import decode, encode


class Echo(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Returns its index."""

    def __init__(self, size: int = 4000) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: Any) -> Any:
        return index


class Curriculum(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """Batches of 4 indices from the easy half of the dataset until the trainer sets
    ``hard`` (mid-epoch, as a curriculum does), then from the hard half; counts its pulls."""

    def __init__(self, batches: int = 40) -> None:
        self.batches = batches
        self.hard = False
        self.pulled = 0

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        for number in range(self.batches):
            self.pulled += 1
            base = 2000 if self.hard else 0
            yield [base + 4 * number + k for k in range(4)]


def _run(cls: Any, switch_after: int) -> tuple[list[list[int]], list[int]]:
    """The batches of one epoch whose sampler turns hard after ``switch_after`` batches,
    and how many times the sampler had been pulled when each batch was yielded."""
    sampler = Curriculum()
    loader = cls(Echo(), batch_sampler=sampler, num_workers=2, prefetch_factor=2)
    batches, pulls = [], []
    try:
        for count, batch in enumerate(loader, 1):
            batches.append(batch.tolist())
            pulls.append(sampler.pulled)
            if count == switch_after:
                sampler.hard = True
    finally:
        if hasattr(loader, "close"):
            loader.close()
    return batches, pulls


def test_a_sampler_the_trainer_changes_mid_epoch_is_pulled_when_torch_pulls_it():
    """Fails when the whole epoch is sampled at iter(): every batch would be easy."""
    ours, our_pulls = _run(zt.DataLoader, switch_after=10)
    theirs, their_pulls = _run(torch.utils.data.DataLoader, switch_after=10)
    assert ours == theirs
    assert our_pulls == their_pulls
    assert our_pulls[0] == 2 * 2 + 1  # prefetch_factor * num_workers, then one per batch
    assert any(batch[0] >= 2000 for batch in ours)


def test_the_first_batch_does_not_sample_the_whole_epoch():
    sampler = Curriculum(batches=10_000)
    loader = zt.DataLoader(Echo(40_000), batch_sampler=sampler, num_workers=2)
    try:
        iterator = iter(loader)
        assert next(iterator).tolist() == [0, 1, 2, 3]
        assert sampler.pulled <= 2 * 2 + 1
        del iterator
    finally:
        loader.close()


def test_the_dispatch_items_carry_any_int_index():
    for keys in ([0, 1, 2], [-1, -2, 5, 2**40, -(2**40)], []):
        items = encode(7, keys)
        assert items[0] == 7 and items[1] == len(keys) and (items >= 0).all()
        assert decode(items[2:].tolist()) == keys


class Negative(torch.utils.data.Sampler):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Any:
        yield from ([-1, -2], [0, 1], [-3])


class Keyed(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A dict-like dataset: its sampler yields str keys."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, key: str) -> int:
        return int(key[1:])


class Keys(torch.utils.data.Sampler):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 12

    def __iter__(self) -> Any:
        yield from (f"k{i}" for i in range(12))


@pytest.mark.parametrize("in_order", [True, False])
def test_negative_indices_and_str_keys_give_torch_s_batches(in_order):
    cases = [dict(dataset=Echo(10), batch_sampler=Negative()),
             dict(dataset=Keyed(), sampler=Keys(), batch_size=5)]
    for kwargs in cases:
        theirs = [b.tolist() for b in torch.utils.data.DataLoader(num_workers=2, **kwargs)]
        loader = zt.DataLoader(num_workers=2, in_order=in_order, **kwargs)
        try:
            ours = [b.tolist() for b in loader]
        finally:
            loader.close()
        assert sorted(ours) == sorted(theirs) and (not in_order or ours == theirs)


class Turncoat(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """Ints, then a str key: the epoch cannot be handed out as it is drawn."""

    def __len__(self) -> int:
        return 8

    def __iter__(self) -> Any:
        yield from ([0], [1], [2], [3], [4], [5], ["six"], [7])


def test_a_sampler_that_turns_from_ints_to_other_keys_is_named():
    loader = zt.DataLoader(Echo(10), batch_sampler=Turncoat(), num_workers=2)
    try:
        with pytest.raises(TypeError, match=r"the sampler yielded the index 'six' \(str\) "
                                            "in batch 6, after batches of ints"):
            list(loader)
    finally:
        loader.close()


def test_dispatch_takes_an_array_of_items_checked_whole():
    import zloader

    pipeline = zloader.Pipeline.range(4)
    with zloader.Loader(pipeline, num_workers=1) as loader:
        with pytest.raises(ValueError, match="items must be >= 0, got -3"):
            loader.dispatch(0, np.array([1, -3], np.int64))
        with pytest.raises(TypeError, match="items must be ints, got an array of float64"):
            loader.dispatch(0, np.array([1.5]))
