"""Sources: their elements, their splits, split shuffling, and argument checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from zloader import Pipeline, PipelineError


def values(pipeline: Pipeline, epoch: int = 0) -> list:
    return list(pipeline.iter(epoch))


def splits_of(pipeline: Pipeline) -> list[list]:
    source = pipeline.source
    return [list(source.read(i)) for i in range(source.num_splits)]


@pytest.mark.parametrize("args", [(10,), (0,), (3, 17), (3, 17, 4), (10, 0, -3), (5, 5)])
def test_range_matches_python_range(args):
    assert values(Pipeline.range(*args)) == list(range(*args))


def test_range_splits_cover_the_range_in_order():
    pipeline = Pipeline.range(2, 23, 2, split_size=4)
    assert splits_of(pipeline) == [[2, 4, 6, 8], [10, 12, 14, 16], [18, 20, 22]]


def test_default_split_size_caps_the_number_of_splits():
    assert Pipeline.range(10).source.num_splits == 10
    assert Pipeline.range(100_000).source.num_splits == 256
    assert Pipeline.range(0).source.num_splits == 0


def test_huge_range_is_not_materialised():
    pipeline = Pipeline.range(10**15).take(3)
    assert values(pipeline) == [0, 1, 2]


def test_shuffle_splits_permutes_whole_splits_per_epoch():
    pipeline = Pipeline.range(40, split_size=5, shuffle_splits=True, seed=3)
    epochs = [values(pipeline, e) for e in range(4)]
    for out in epochs:
        assert sorted(out) == list(range(40))
        chunks = [out[i:i + 5] for i in range(0, 40, 5)]
        assert all(chunk == list(range(chunk[0], chunk[0] + 5)) for chunk in chunks)
    assert len({tuple(out) for out in epochs}) == 4  # the order changes every epoch
    assert values(pipeline, 2) == epochs[2]  # and is reproducible


def test_from_items_keeps_items_and_copies_the_sequence():
    items = ["a", {"k": 1}, None, 3.5]
    pipeline = Pipeline.from_items(items, split_size=3)
    items.append("late")
    assert values(pipeline) == ["a", {"k": 1}, None, 3.5]
    assert splits_of(pipeline) == [["a", {"k": 1}, None], [3.5]]


def test_from_items_of_empty():
    assert values(Pipeline.from_items([])) == []


def test_from_arrays_yields_rows_of_every_array():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.arange(6)
    out = values(Pipeline.from_arrays({"x": x, "pair": (y, y * 10)}, split_size=4))
    assert len(out) == 6
    assert out[4]["x"].tolist() == [8.0, 9.0]
    assert out[4]["pair"] == (4, 40)


def test_from_arrays_rows_are_read_only_views():
    data = np.zeros((4, 3))
    row = values(Pipeline.from_arrays(data))[0]
    assert np.shares_memory(row, data)
    with pytest.raises(ValueError, match="read-only"):
        row[0] = 1.0
    assert data.flags.writeable  # the caller's own array is untouched


@pytest.mark.parametrize("structure, error, message", [
    ({"a": np.zeros(3), "b": np.zeros(4)}, ValueError, "same length"),
    (np.float32(1.0), ValueError, "scalar"),
    ({}, ValueError, "empty dict"),
    (np.array([object()]), TypeError, "dtype object"),
])
def test_from_arrays_rejects_bad_structures(structure, error, message):
    with pytest.raises(error, match=message):
        Pipeline.from_arrays(structure)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path):
    with open(path) as f:
        for line in f:
            yield json.loads(line)


def test_from_files_glob_gives_one_split_per_file_in_sorted_order(tmp_path):
    for name, rows in [("b.jsonl", [3, 4]), ("a.jsonl", [1, 2]), ("c.jsonl", [])]:
        write_jsonl(tmp_path / name, rows)
    pipeline = Pipeline.from_files(str(tmp_path / "*.jsonl"), read_jsonl)
    assert pipeline.source.num_splits == 3
    assert values(pipeline) == [1, 2, 3, 4]
    assert splits_of(pipeline) == [[1, 2], [3, 4], []]


def test_from_files_list_keeps_given_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ["a"])
    b = write_jsonl(tmp_path / "b.jsonl", ["b"])
    assert values(Pipeline.from_files([b, a], read_jsonl)) == ["b", "a"]


def test_from_files_errors(tmp_path):
    with pytest.raises(ValueError, match="matched no files"):
        Pipeline.from_files(str(tmp_path / "*.none"), read_jsonl)
    with pytest.raises(ValueError, match="cannot read"):
        Pipeline.from_files([tmp_path / "missing.txt"], read_jsonl)
    with pytest.raises(ValueError, match="not a file"):
        Pipeline.from_files([tmp_path], read_jsonl)
    with pytest.raises(TypeError, match="reader must be callable"):
        Pipeline.from_files(str(tmp_path), None)


def test_reader_error_names_the_source_and_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(PipelineError, match=r"bad\.jsonl") as info:
        values(Pipeline.from_files([bad], read_jsonl))
    assert isinstance(info.value, ValueError)  # json.JSONDecodeError is a ValueError
    assert info.value.stage == "from_files"
    assert info.value.exc_type == "json.decoder.JSONDecodeError"


def test_from_torch_reads_a_real_torch_dataset():
    dataset = torch.utils.data.TensorDataset(torch.arange(10) * 2, torch.arange(10))
    out = values(Pipeline.from_torch(dataset, split_size=4))
    assert [int(a) for a, _ in out] == [2 * i for i in range(10)]
    assert Pipeline.from_torch(dataset, split_size=4).source.num_splits == 3
    batch = values(Pipeline.from_torch(dataset).batch(10))[0]
    assert batch[0].tolist() == [2 * i for i in range(10)]


def test_from_torch_error_names_the_index():
    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, index):
            if index == 3:
                raise IndexError("no three")
            return index

    with pytest.raises(IndexError) as info:
        values(Pipeline.from_torch(Broken()))
    assert "index 3" in str(info.value)


def test_from_torch_rejects_iterable_datasets():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(TypeError, match="from_generator"):
        Pipeline.from_torch(Stream())


def test_from_generator_calls_fn_per_split():
    pipeline = Pipeline.from_generator(lambda n: range(n * 10, n * 10 + n), [1, 2, 3])
    assert values(pipeline) == [10, 20, 21, 30, 31, 32]
    assert values(Pipeline.from_generator(lambda s: [s], 3)) == [0, 1, 2]


def test_from_generator_shuffled_splits_and_errors():
    pipeline = Pipeline.from_generator(lambda s: [s], 20, shuffle_splits=True, seed=1)
    assert sorted(values(pipeline)) == list(range(20)) and values(pipeline) != list(range(20))

    def gen(split):
        yield split
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        values(Pipeline.from_generator(gen, ["x"]))
    assert info.value.stage == "from_generator(gen)" and "split 'x'" in str(info.value)

    with pytest.raises(TypeError, match="splits must be"):
        Pipeline.from_generator(gen, "abc")


@pytest.mark.parametrize("build, message", [
    (lambda: Pipeline.range(5, split_size=0), "split_size must be >= 1"),
    (lambda: Pipeline.range(1, 5, 0), "step must not be zero"),
    (lambda: Pipeline.range("5"), "stop must be an int"),
    (lambda: Pipeline.range(5, shuffle_splits="yes"), "shuffle_splits must be True or False"),
    (lambda: Pipeline.range(5, seed=1.5), "seed must be an int"),
    (lambda: Pipeline.from_items(5), "items must be a list"),
    (lambda: Pipeline.from_items("abc"), "items must be a list"),
    (lambda: Pipeline.range(5, version=""), "version must be a non-empty str"),
])
def test_source_argument_errors_name_the_argument(build, message):
    with pytest.raises((TypeError, ValueError), match=message):
        build()
