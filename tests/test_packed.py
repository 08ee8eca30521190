"""Large lists packed for forked workers (zloader/packed.py): the packed view reads as the
list does, what is not plain data is left alone, the trainer's objects are untouched, and
workers that read the whole dataset do not copy it."""

from __future__ import annotations

import enum
import itertools
import pickle
import sys

import hypothesis.strategies as st
import numpy as np
import psutil
import pytest
from hypothesis import given, settings

import zloader
from zloader import packed
from zloader.fingerprint import fingerprint
from zloader.packed import PACK_MIN_ITEMS, pack, packable

atoms = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
         | st.text(max_size=12) | st.binary(max_size=12))
plain = st.recursive(
    atoms, lambda inner: st.tuples(inner, inner) | st.tuples(inner)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


def _long(values: list[object]) -> list[object]:
    """``values`` repeated to the packing threshold."""
    return list(itertools.islice(itertools.cycle(values), PACK_MIN_ITEMS + 3))


@settings(max_examples=40, deadline=None)
@given(st.lists(plain, min_size=1, max_size=20), st.booleans())
def test_the_packed_view_returns_equal_values_at_every_index(values, as_tuple):
    original = _long(values)
    if as_tuple:
        original = tuple(original)  # type: ignore[assignment]
    view = pack(original)
    assert view is not None
    assert len(view) == len(original)
    for index in range(len(original)):
        assert view[index] == original[index]
        assert type(view[index]) is type(original[index])
    assert view[-1] == original[-1] and view[2:9:3] == original[2:9:3]
    assert list(view) == list(original) and view == original
    assert pickle.loads(pickle.dumps(view)) == original  # pickles as the list it reads as


def test_lists_of_ints_or_floats_pack_as_arrays():
    ints = list(range(-5, PACK_MIN_ITEMS))
    floats = [x / 3 for x in range(PACK_MIN_ITEMS)]
    huge = [2**70, *ints]  # beyond int64: marshalled
    for values in (ints, floats, huge):
        view = pack(values)
        assert view is not None and view == values
        assert all(type(a) is type(b) for a, b in zip(view, values, strict=True))
    assert pack(ints).nbytes == 8 * len(ints)  # type: ignore[union-attr]
    with pytest.raises(IndexError):
        pack(ints)[len(ints)]  # type: ignore[index]


class Colour(enum.IntEnum):
    RED = 1


class Paths(list):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize("values", [
    Paths(["a"] * PACK_MIN_ITEMS),  # a list subclass: left as it is
    [object()] * PACK_MIN_ITEMS,  # not an atom
    [Colour.RED] * PACK_MIN_ITEMS,  # an int subclass
    [np.int64(3)] * PACK_MIN_ITEMS,  # a numpy scalar
    [("a", [1])] * PACK_MIN_ITEMS,  # a list inside: a mutable element
    [{1: "a"}] * PACK_MIN_ITEMS,  # a dict whose keys are not str
    ["a"] * (PACK_MIN_ITEMS - 1),  # short
    [(((((1,),),),),)] * PACK_MIN_ITEMS,  # nested deeper than the packer looks
], ids=["subclass", "object", "intenum", "numpy", "list", "int-keys", "short", "deep"])
def test_what_is_not_plain_data_is_left_alone(values):
    assert pack(values) is None


def test_packable_names_what_it_takes():
    assert packable([1, "a", None, (2.5, b"x"), {"k": (1, 2)}])
    assert not packable([1, [2]])


class Dataset:  # torch's Dataset, as the packer recognises it (by its module)
    pass


Dataset.__module__ = "torch.utils.data.dataset"


class Notes:
    """Not a dataset: held by one, its attributes are left alone (a library's object)."""

    def __init__(self) -> None:
        self.lines = [f"note {i}" for i in range(PACK_MIN_ITEMS)]


class Folder(Dataset):
    """A map-style dataset like torchvision's ImageFolder: ``imgs`` is ``samples``."""

    def __init__(self, size: int) -> None:
        self.samples = [(f"/data/train/class{i % 7}/img_{i:07d}.jpg", i % 7)
                        for i in range(size)]
        self.imgs = self.samples
        self.targets = [label for _, label in self.samples]
        self.classes = [f"class{i}" for i in range(7)]  # short: left as it is

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[str, int, int]:
        path, label = self.samples[index]
        return path, label, self.targets[index] + isinstance(self.imgs, list)


class Subset(Dataset):
    def __init__(self, dataset: Folder, indices: list[int]) -> None:
        self.dataset = dataset
        self.indices = indices
        self.notes = Notes()

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> object:
        return self.dataset[self.indices[index]]


def test_the_plan_packs_dataset_attributes_once_and_leaves_the_trainers_objects():
    folder = Folder(PACK_MIN_ITEMS * 2)
    subset = Subset(folder, list(range(0, len(folder), 2)))
    samples, targets = folder.samples, list(folder.targets)
    swaps = packed.plan(zloader.Pipeline.from_torch(subset).source)
    assert sorted(s.where for s in swaps) == [
        "TorchSource.dataset.dataset.imgs", "TorchSource.dataset.dataset.samples",
        "TorchSource.dataset.dataset.targets", "TorchSource.dataset.indices"]
    views = {s.name: s.view for s in swaps}
    assert views["imgs"] is views["samples"]  # one pack for one list
    assert folder.samples is samples and folder.imgs is samples and type(samples) is list
    assert folder.targets == targets and "classes" not in views


def test_the_fingerprint_hashes_the_packed_bytes_the_same():
    items = [(f"path/{i}", i) for i in range(PACK_MIN_ITEMS)]
    plain_print = fingerprint([("source", (items,))])
    with packed.offered(packed.plan(zloader.Pipeline.from_items(items).source)):
        assert packed.flat_chunks(items) is None  # a copy of the tuple was packed, not this
    swap = packed.Swap(owner=None, name="x", old=items, view=pack(items), where="x")
    with packed.offered([swap]):
        assert packed.flat_chunks(items) is not None
        assert fingerprint([("source", (items,))]) == plain_print
    assert packed.flat_chunks(items) is None  # offered only within


def _read_all(dataset: object, pack_dataset: bool, workers: int = 2) -> list[object]:
    pipeline = zloader.Pipeline.from_torch(dataset, split_size=1024)
    with zloader.Loader(pipeline, num_workers=workers, pack_dataset=pack_dataset) as loader:
        return sorted(loader)


def test_forked_workers_read_the_packed_dataset_as_the_list():
    folder = Folder(PACK_MIN_ITEMS + 500)
    expected = sorted(folder[i] for i in range(len(folder)))
    # Workers that read the packed lists see PackedSequence, not list: the last field says
    got = _read_all(folder, pack_dataset=True)
    assert [g[:2] for g in got] == [e[:2] for e in expected]
    assert {g[2] - e[2] for g, e in zip(got, expected, strict=True)} == {-1}
    assert _read_all(folder, pack_dataset=False) == expected
    assert type(folder.samples) is list and type(folder.imgs) is list  # the trainer's own


def test_workers_see_the_dataset_as_it_was_when_the_loader_forked_them():
    folder = Folder(PACK_MIN_ITEMS)
    folder.samples[0] = ("/changed/before", 99)  # before the Loader: packed as it is now
    pipeline = zloader.Pipeline.from_torch(folder, split_size=1024)
    with zloader.Loader(pipeline, num_workers=2) as loader:
        folder.samples[1] = ("/changed/after", 98)  # after the fork: no worker sees it,
        paths = {element[0] for element in loader}  # packed or not (as torch's workers)
    assert "/changed/before" in paths and "/changed/after" not in paths


def test_the_torch_dataloader_repacks_for_each_pass_of_fresh_workers():
    zt = pytest.importorskip("zloader.torch")
    folder = Folder(PACK_MIN_ITEMS)
    loader = zt.DataLoader(folder, batch_size=512, num_workers=2)
    first = [path for batch in loader for path in batch[0]]
    folder.samples[3] = ("/renamed", 3)  # between passes: the next workers see it, as torch's
    second = [path for batch in loader for path in batch[0]]
    assert "/renamed" not in first and "/renamed" in second


def test_pack_dataset_is_checked():
    with pytest.raises(TypeError, match="pack_dataset"):
        zloader.Loader(zloader.Pipeline.range(4), num_workers=1, pack_dataset="yes")


def _private_heap_kib(pid: int) -> int:
    """A process's private memory outside shared mappings (its own Python objects)."""
    total, counted = 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                name = fields[5] if len(fields) > 5 else ""
                counted = not name.startswith(("/dev/shm", "/dev/zero", "/SYSV"))
            elif counted and fields[0] in ("Private_Clean:", "Private_Dirty:"):
                total += int(fields[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc smaps")
@pytest.mark.parametrize("pack_dataset", [True, False])
def test_workers_reading_every_sample_do_not_copy_the_dataset(pack_dataset):
    size = 400_000
    folder = Folder(size)
    one_copy_kib = (sys.getsizeof(folder.samples) + size * (
        sys.getsizeof(folder.samples[-1]) + sys.getsizeof(folder.samples[-1][0]))) / 1024
    pipeline = zloader.Pipeline.from_torch(folder, split_size=8192).map(len).batch(4096)
    with zloader.Loader(pipeline, num_workers=2, pack_dataset=pack_dataset) as loader:
        workers = [psutil.Process(p.pid) for p in loader._processes]
        batches = iter(loader)
        seen = len(next(batches))
        before = [_private_heap_kib(w.pid) for w in workers]
        seen += sum(map(len, batches))
        growth = [_private_heap_kib(w.pid) - b for w, b in zip(workers, before, strict=True)]
    assert seen == size
    if pack_dataset:  # a few MiB of the worker's own, not its share of the dataset: its
        # records in flight, more of them when the consumer lags (a loaded machine: 4.9 MiB
        # seen in one worker), against half a copy and more without packing
        assert sum(growth) < 0.2 * one_copy_kib, (growth, one_copy_kib)
    else:  # each worker copied the pages of the half it read (the test can fail)
        assert sum(growth) > 0.5 * one_copy_kib, (growth, one_copy_kib)


def _read(path: str) -> list[str]:
    return [path]


def _shard(name: str) -> list[str]:
    return [name]


def test_the_plan_packs_the_sources_own_lists(tmp_path):
    items = [(f"item {i}", i) for i in range(PACK_MIN_ITEMS)]
    for index in range(PACK_MIN_ITEMS):
        (tmp_path / f"{index}.txt").write_bytes(b"")
    sources = {
        "ItemsSource.items": zloader.Pipeline.from_items(items),
        "FilesSource.files": zloader.Pipeline.from_files(str(tmp_path / "*.txt"), _read),
        "GeneratorSource.splits": zloader.Pipeline.from_generator(
            _shard, [f"shard-{i}" for i in range(PACK_MIN_ITEMS)]),
        "TorchSource.dataset": zloader.Pipeline.from_torch(list(items)),  # a list itself
    }
    for where, pipeline in sources.items():
        assert [swap.where for swap in packed.plan(pipeline.source)] == [where]
    with zloader.Loader(sources["ItemsSource.items"].map(lambda pair: pair[1]),
                        num_workers=2) as loader:
        assert sorted(loader) == list(range(PACK_MIN_ITEMS))
    with zloader.Loader(sources["FilesSource.files"], num_workers=2) as loader:
        assert sorted(loader) == sorted(str(p) for p in tmp_path.glob("*.txt"))


def test_the_plan_packs_a_mixs_inputs_lists():
    pairs = [(f"item {i}", i) for i in range(PACK_MIN_ITEMS)]
    rows = [{"id": i} for i in range(PACK_MIN_ITEMS)]
    mix = zloader.Pipeline.mix([zloader.Pipeline.from_items(pairs),
                                zloader.Pipeline.from_items(rows),
                                zloader.Pipeline.range(10)], seed=1)
    swaps = packed.plan(mix.source)
    assert [swap.where for swap in swaps] == ["ItemsSource.items", "ItemsSource.items"]
    assert {id(swap.old) for swap in swaps} == {id(mix.source.inputs[0].source.items),
                                                  id(mix.source.inputs[1].source.items)}
    with zloader.Loader(mix, num_workers=2) as loader:
        got = list(loader)
    assert sorted(map(repr, got)) == sorted(map(repr, mix.iter(0)))
