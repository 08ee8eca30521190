"""Large lists packed for forked workers (zloader/packed.py): the packed view reads as the
list does, what is not plain data is left alone, the trainer's objects are untouched, and
workers that read the whole dataset do not copy it."""

from __future__ import annotations

import collections
import collections.abc
import enum
import itertools
import operator
import pathlib
import pickle
import sys

import hypothesis.strategies as st
import numpy as np
import psutil
import pytest
from hypothesis import given, settings

import zloader
from zloader import packed
from zloader._defaults import PACK_MIN_BYTES
from zloader.fingerprint import fingerprint
from zloader.packed import PACK_MIN_ITEMS, pack, packable


@pytest.fixture(autouse=True)
def pack_small_lists(monkeypatch):
    """These tests pack lists of a few thousand elements, which a Loader leaves unpacked
    (a worker's copy of them costs less than packing them would: PACK_MIN_BYTES)."""
    monkeypatch.setattr(zloader.loader, "PACK_MIN_BYTES", 0)

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


class Field(enum.StrEnum):
    LABEL = "label"


class Raw(bytes):
    pass


class Text(str):
    pass


Pair = collections.namedtuple("Pair", "path label")


def _rows(count: int) -> list[dict[str, object]]:
    return [{"path": f"/data/{i}.jpg", "label": i % 7} for i in range(count)]


def _one_odd(values: list[object], odd: object) -> list[object]:
    """``values`` with element 5 replaced by ``odd``: every other element is plain."""
    values[5] = odd
    return values


@pytest.mark.parametrize("values", [
    _one_odd(_rows(PACK_MIN_ITEMS), {"path": "/data/5.jpg", Field.LABEL: 5}),
    _one_odd(_rows(PACK_MIN_ITEMS), {"path": "/data/5.jpg", "label": Colour.RED}),
    _one_odd(_rows(PACK_MIN_ITEMS), {"path": Text("/data/5.jpg"), "label": 5}),
    _one_odd([(f"/data/{i}.jpg", i) for i in range(PACK_MIN_ITEMS)], Pair("/data/5.jpg", 5)),
    _one_odd([(f"/data/{i}.jpg", i) for i in range(PACK_MIN_ITEMS)], ("/data/5.jpg", Colour.RED)),
    _one_odd([(f"/data/{i}.jpg", (i, i)) for i in range(PACK_MIN_ITEMS)], ("/5", Pair(5, 5))),
    _one_odd([f"/data/{i}.jpg" for i in range(PACK_MIN_ITEMS)], Field.LABEL),
    _one_odd([b"%d" % i for i in range(PACK_MIN_ITEMS)], Raw(b"5")),  # marshal takes it
    _one_odd([(b"%d" % i, i) for i in range(PACK_MIN_ITEMS)], (Raw(b"5"), 5)),  # as bytes
], ids=["strenum-key", "intenum-value", "str-subclass-value", "namedtuple", "intenum-in-tuple",
        "namedtuple-in-tuple", "strenum", "bytes-subclass", "bytes-subclass-in-tuple"])
def test_a_subclass_in_one_element_leaves_the_list_as_it_is(values):
    """Marshal refuses a subclass of a builtin, or turns a bytes subclass into bytes: the
    worker would read another type than the dataset holds, or packing would raise. The
    first element is plain, so the checks must look at every element."""
    assert pack(values) is None


def _types(value: object) -> object:
    """``value``'s type, with those of what it holds (dict keys included)."""
    if isinstance(value, tuple):
        return (type(value), *map(_types, value))
    if isinstance(value, dict):
        return (type(value), *((_types(k), _types(v)) for k, v in value.items()))
    return type(value)


odd_atoms = st.sampled_from([Field.LABEL, Colour.RED, Raw(b"r"), Text("t"), Pair("p", 1)])
placed = st.sampled_from([lambda odd: odd, lambda odd: ("x", odd), lambda odd: {"k": odd},
                          lambda odd: {odd: 1}, lambda odd: {"k": ((odd,),)}])


@settings(max_examples=60, deadline=None)
@given(st.lists(plain, min_size=1, max_size=12), st.integers(0, 40), placed, odd_atoms)
def test_packing_never_changes_a_type_and_never_raises(values, at, place, odd):
    original = _long(values)
    view = pack(original)  # plain data packs, and keeps every type it holds
    assert view is not None
    assert [_types(view[i]) for i in range(len(values))] == list(map(_types, values))
    original[at] = place(odd)
    assert pack(original) is None


WRITES = {
    "set": lambda s: s.__setitem__(3, ("set", 3)),
    "set-negative": lambda s: s.__setitem__(-2, ("set", -2)),
    "set-slice": lambda s: s.__setitem__(slice(1, 4), [("a", 1)]),
    "set-extended-slice": lambda s: s.__setitem__(slice(0, 6, 2), [("b", 1)] * 3),
    "del": lambda s: s.__delitem__(-1),
    "del-slice": lambda s: s.__delitem__(slice(0, 10, 3)),
    "append": lambda s: s.append(("end", 1)),
    "extend": lambda s: s.extend([("x", 2), ("y", 3)]),
    "extend-itself": lambda s: s.extend(s),
    "insert": lambda s: s.insert(2, ("in", 4)),
    "pop": lambda s: s.pop(),
    "pop-first": lambda s: s.pop(0),
    "remove": lambda s: s.remove(s[5]),
    "sort": lambda s: s.sort(key=repr, reverse=True),
    "reverse": lambda s: s.reverse(),
    "iadd": lambda s: operator.iadd(s, [("z", 9)]) is s,
    "imul": lambda s: operator.imul(s, 2) is s,
    "clear": lambda s: s.clear(),
    "shuffle": lambda s: __import__("random").Random(0).shuffle(s),
}


@pytest.mark.parametrize("kind", ["marshal", "array"])
@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_a_written_packed_list_is_this_processs_own_list(write, kind):
    """Each write a list takes, then the same reads as the list (a worker's memo cache,
    a dataset that shuffles or extends its samples): only this view changes."""
    original = ([(f"/data/{i}.jpg", i % 7) for i in range(PACK_MIN_ITEMS)] if kind == "marshal"
                else list(range(PACK_MIN_ITEMS)))
    expected = list(original)
    view = pack(original)
    assert view is not None
    layout = "marshal" if kind == "marshal" else "q"  # (int64: see pack)
    again = packed.PackedSequence(view._memory, len(original), layout, list)
    assert write(view) == write(expected)  # (what the write returns, too)
    assert view == expected and list(view) == expected and len(view) == len(expected)
    assert [view[i] for i in range(-len(expected), len(expected))] == expected * 2
    assert view[1:7:2] == expected[1:7:2] and pickle.loads(pickle.dumps(view)) == expected
    assert again == original  # the shared memory is as it was: other workers read that
    view[0:0] = ["later"]
    assert view[0] == "later" and expected == list(view)[1:]


def test_a_packed_list_makes_new_lists_and_compares_as_a_list():
    original = [(f"/data/{i}.jpg", i) for i in range(PACK_MIN_ITEMS)]
    view = pack(original)
    assert view is not None
    add = operator.add  # (the operators are what is tested)
    assert add(view, [("x", 1)]) == add(original, [("x", 1)]) and type(add(view, [])) is list
    assert add([("x", 1)], view) == add([("x", 1)], original)
    assert view * 2 == original * 2 == 2 * view
    assert view.copy() == original and view.copy() is not view.copy()
    assert view < [*original, ("z", 1)] and view >= original and not view > original
    assert view.index(original[9]) == 9 and view.count(original[9]) == 1
    assert original[9] in view and list(reversed(view)) == original[::-1]
    with pytest.raises(TypeError):
        add(view, (1,))  # as a list: no list + tuple


def test_a_packed_tuple_cannot_change_as_a_tuple_cannot():
    original = tuple(f"/data/{i}.jpg" for i in range(PACK_MIN_ITEMS))
    view = pack(original)
    assert view is not None
    for write in (WRITES["set"], WRITES["del"], WRITES["append"], WRITES["sort"]):
        with pytest.raises(TypeError, match="'tuple' object does not support"):
            write(view)
    grown = view
    grown += ("end",)
    assert grown == (*original, "end") and type(grown) is tuple and view == original
    assert view * 2 == original * 2 and type(operator.add(view, ())) is tuple


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
                counted = not name.startswith(
                    ("/dev/shm", "/dev/zero", "/SYSV", "/memfd:"))
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


class Level(enum.IntEnum):
    LOW = 0
    HIGH = 1


class Rows(Dataset):
    """A list of dicts, one of them unlike the others (element 5, not the first)."""

    def __init__(self, count: int, odd: dict[object, object]) -> None:
        self.samples: list[dict[object, object]] = [
            {"path": f"/data/{i}.jpg", "label": i % 7} for i in range(count)]
        self.samples[5] = odd

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> str:
        return repr(self.samples[index])  # (the keys' and values' types show in a repr)


class Memo(Dataset):
    """A dataset that memoises its samples into its own list, as torch users write it."""

    def __init__(self, count: int) -> None:
        self.cache: list[object] = [None] * count

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int) -> tuple[str, int]:
        if self.cache[index] is None:
            self.cache[index] = (f"/data/{index}.jpg", index % 7)
        return self.cache[index]  # type: ignore[return-value]


def _plain_batches(loader: object) -> list[object]:
    """The loader's batches, tensors as lists (both loaders' batches compare so)."""
    def plain(value: object) -> object:
        if hasattr(value, "tolist"):
            return ("tensor", str(value.dtype), value.tolist())  # type: ignore[attr-defined]
        if isinstance(value, (list, tuple)):
            return [type(value).__name__, *map(plain, value)]
        return value
    return [plain(batch) for batch in loader]  # type: ignore[attr-defined]


def _as_torch(dataset: object, **kwargs: object) -> tuple[list[object], list[object]]:
    """The batches of torch's DataLoader and of the drop-in, built alike (2 workers)."""
    torch = pytest.importorskip("torch")
    zt = pytest.importorskip("zloader.torch")
    made = []
    for cls in (torch.utils.data.DataLoader, zt.DataLoader):
        loader = cls(dataset, num_workers=2, generator=torch.Generator().manual_seed(0),
                     **kwargs)
        try:
            made.append(_plain_batches(loader))
        finally:
            if cls is zt.DataLoader:
                loader.close()
    return made[0], made[1]


@pytest.mark.parametrize("odd", [
    {"path": "/data/5.jpg", Field.LABEL: 5},  # a StrEnum key: marshal refuses it
    {"path": "/data/5.jpg", "label": Level.HIGH},  # an IntEnum value
], ids=["strenum-key", "intenum-value"])
def test_the_torch_dataloader_reads_a_list_packing_cannot_take_as_torch_does(odd):
    dataset = Rows(10_000, odd)
    assert packed.plan(zloader.Pipeline.from_torch(dataset).source) == []  # left a list
    reference, ours = _as_torch(dataset, batch_size=250, shuffle=True)
    assert ours == reference
    assert repr(odd) in itertools.chain.from_iterable(ours)  # its types, as the dataset's


def test_a_dataset_that_memoises_into_its_own_list_reads_as_with_torch():
    dataset = Memo(10_000)
    assert [s.where for s in packed.plan(zloader.Pipeline.from_torch(dataset).source)] == [
        "TorchSource.dataset.cache"]  # the list of Nones is packed
    reference, ours = _as_torch(dataset, batch_size=250, shuffle=True)
    assert ours == reference and len(ours) == 40
    assert dataset.cache == [None] * 10_000  # each worker wrote its own copy, as torch's


class Kinds(Dataset):
    """Says what its list is, in the process that reads it."""

    def __init__(self) -> None:
        self.samples = [f"/data/{i}.jpg" for i in range(PACK_MIN_ITEMS)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> str:
        samples = self.samples
        return (f"{type(samples).__name__} list={isinstance(samples, list)} "
                f"mutable={isinstance(samples, collections.abc.MutableSequence)}")


def test_in_a_worker_a_packed_list_is_a_mutable_sequence_but_not_a_list():
    """Documented (docs/torch.md, differences): a list subclass would hold its elements
    as Python objects, which is what packing avoids; pack_dataset=False keeps the list."""
    zt = pytest.importorskip("zloader.torch")
    seen = {}
    for pack_dataset in (True, False):
        loader = zt.DataLoader(Kinds(), batch_size=1024, num_workers=2,
                               pack_dataset=pack_dataset)
        try:
            seen[pack_dataset] = set(itertools.chain.from_iterable(loader))
        finally:
            loader.close()
    assert seen == {True: {"PackedSequence list=False mutable=True"},
                    False: {"list list=True mutable=True"}}
    docs = (pathlib.Path(__file__).parents[1] / "docs" / "torch.md").read_text()
    differences = docs[docs.index("## Differences from torch"):]
    assert "`isinstance(self.samples, list)` is False" in differences
    assert "pack_dataset=False" in differences


def test_lists_a_worker_would_copy_little_of_are_left_as_they_are(monkeypatch):
    """Packing before the fork makes the first batch wait (about 0.5 us an element): a
    list whose objects a worker would copy fewer than PACK_MIN_BYTES of is not packed."""
    folder = Folder(PACK_MIN_ITEMS + 500)
    assert packed.copied_bytes(packed.found(zloader.Pipeline.from_torch(folder).source)) \
        < PACK_MIN_BYTES
    expected = sorted(folder[i] for i in range(len(folder)))
    assert {g[2] - e[2] for g, e in zip(_read_all(folder, True), expected, strict=True)} \
        == {-1}  # (packed: this module's fixture packs every list)
    monkeypatch.setattr(zloader.loader, "PACK_MIN_BYTES", PACK_MIN_BYTES)
    assert _read_all(folder, pack_dataset=True) == expected  # a list in each worker
