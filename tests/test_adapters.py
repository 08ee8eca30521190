"""The torch and tf.data adapters, against the pipeline's own output."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import tensorflow as tf
import torch

import zloader.tf
import zloader.torch
from zloader import Pipeline


def image_pipeline() -> Pipeline:
    images = np.arange(10 * 4 * 3, dtype=np.float32).reshape(10, 4, 3)
    return (Pipeline.from_arrays({"image": images, "label": np.arange(10)})
            .map(lambda e: {**e, "name": f"img{int(e['label'])}"})
            .shuffle(10, seed=3).batch(4))


def test_torch_dataset_yields_the_pipeline_as_tensors():
    pipeline = image_pipeline()
    dataset = zloader.torch.IterableDataset(pipeline, num_workers=1, timeout=30)
    try:
        got = list(dataset)
    finally:
        dataset.close()
    expected = list(pipeline.iter(0))
    assert len(got) == len(expected) == 3
    for batch, reference in zip(got, expected, strict=True):
        assert isinstance(batch["image"], torch.Tensor) and batch["image"].dtype == torch.float32
        assert torch.equal(batch["image"], torch.from_numpy(reference["image"]))
        assert batch["label"].tolist() == reference["label"].tolist()
        assert batch["name"] == reference["name"]


@pytest.mark.parametrize("kwargs", [{"num_workers": 0}, {"num_workers": 1, "timeout": 30}])
def test_torch_dataset_advances_epochs_and_honours_set_epoch(kwargs):
    pipeline = Pipeline.range(20).shuffle(20, seed=1)
    dataset = zloader.torch.IterableDataset(pipeline, **kwargs)
    try:
        first, second = [int(x) for x in dataset], [int(x) for x in dataset]
        assert first == list(pipeline.iter(0)) and second == list(pipeline.iter(1))
        dataset.set_epoch(7)
        assert [int(x) for x in dataset] == list(pipeline.iter(7))
        with pytest.raises(ValueError, match="only move forward"):
            dataset.set_epoch(3)
    finally:
        dataset.close()


def test_torch_dataset_iterators_never_hang_a_newer_one_ends_the_older():
    dataset = zloader.torch.IterableDataset(Pipeline.range(100, split_size=10), num_workers=1,
                                            timeout=30)
    try:
        older, newer = iter(dataset), iter(dataset)
        assert next(older, None) is None  # one epoch at a time, as torch's persistent workers
        assert sorted(int(x) for x in newer) == list(range(100))
        held = iter(dataset)
        next(held)
        assert sorted(int(x) for x in dataset) == list(range(100))  # a peek, then a loop
        assert next(held, None) is None
    finally:
        dataset.close()


def test_torch_tensors_share_writable_memory_and_copy_read_only_rows():
    writable = np.zeros(3)
    assert np.shares_memory(zloader.torch.to_torch(writable).numpy(), writable)
    row = next(iter(Pipeline.from_arrays(np.zeros((2, 3)))))
    tensor = zloader.torch.to_torch(row)
    tensor += 1  # must not write into the pipeline's source
    assert not np.shares_memory(tensor.numpy(), row) and row.sum() == 0


@pytest.mark.slow  # torch takes 5 s to shut its worker down after the error
def test_torch_dataloader_with_workers_is_refused_clearly():
    loader = torch.utils.data.DataLoader(
        zloader.torch.IterableDataset(Pipeline.range(4), num_workers=0), num_workers=1,
        batch_size=None)
    iterator = iter(loader)
    message = ""
    try:
        next(iterator)
    except RuntimeError as exc:
        message = str(exc)
    del iterator  # shuts torch's worker down (the leak check would catch it otherwise)
    gc.collect()
    assert "num_workers=0" in message


def test_torch_dataloader_without_workers_passes_batches_through():
    dataset = zloader.torch.IterableDataset(Pipeline.range(10).batch(4), num_workers=1,
                                            timeout=30)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None)
    try:
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    finally:
        dataset.close()


def test_tf_dataset_yields_the_pipeline_and_infers_the_spec():
    pipeline = image_pipeline()
    dataset = zloader.tf.to_dataset(pipeline)
    assert dataset.element_spec["image"].dtype == tf.float32
    assert dataset.element_spec["name"].dtype == tf.string
    got = list(dataset.as_numpy_iterator())
    expected = list(pipeline.iter(0))
    assert len(got) == 3  # the last batch is shorter and still fits the inferred spec
    for batch, reference in zip(got, expected, strict=True):
        np.testing.assert_array_equal(batch["image"], reference["image"])
        assert [n.decode() for n in batch["name"]] == reference["name"]


def test_tf_dataset_runs_one_epoch_per_iteration():
    pipeline = Pipeline.range(12).shuffle(12, seed=4)
    dataset = zloader.tf.to_dataset(pipeline)
    first = [int(x) for x in dataset.as_numpy_iterator()]
    second = [int(x) for x in dataset.as_numpy_iterator()]
    assert first == list(pipeline.iter(0)) and second == list(pipeline.iter(1))


def test_tf_adapter_errors():
    with pytest.raises(ValueError, match="pass spec="):
        zloader.tf.to_dataset(Pipeline.range(0))
    with pytest.raises(TypeError, match="cannot hold a NoneType"):
        zloader.tf.to_dataset(Pipeline.from_items([None]))
    with pytest.raises(TypeError, match=r"zloader\.Pipeline"):
        zloader.tf.to_dataset([1, 2])


def test_tf_dataset_reads_through_zloader_workers_and_infers_varying_dims():
    pipeline = image_pipeline()
    ds = zloader.tf.dataset(pipeline, num_workers=2, timeout=30)
    try:
        assert ds.element_spec["image"].shape.as_list() == [None, 4, 3]  # short last batch
        for _ in range(2):
            epoch = list(ds.as_numpy_iterator())
            assert sorted(int(i) for b in epoch for i in b["label"]) == list(range(10))
    finally:
        zloader.tf.close(ds)


def test_keras_trains_two_epochs_on_a_zloader_dataset_and_sees_every_element():
    import keras

    features = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
    targets = features.sum(axis=1, keepdims=True)
    pipeline = Pipeline.from_arrays((features, targets)).batch(16)
    # One worker, so batches are whole (with two, each batches its own rows).
    ds = zloader.tf.dataset(pipeline, num_workers=1, timeout=30)

    class Count(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.batches = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1

        def on_epoch_end(self, epoch, logs=None):
            seen.append(self.batches)

    seen: list[int] = []
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    try:
        history = model.fit(ds, epochs=2, verbose=0, shuffle=False, callbacks=[Count()])
    finally:
        zloader.tf.close(ds)
    assert len(history.history["loss"]) == 2
    assert seen == [6, 6]  # 96 rows / 16: every element, each epoch


# slow: train and validation Loaders on one broker stay in the fast suite
# (test_pool_service.py), and so does keras fitting on a zloader dataset
@pytest.mark.slow
def test_keras_fit_with_validation_data_over_one_broker_runs_every_epoch_of_both():
    """``fit(validation_data=...)``: the validation dataset's job starts while the training
    job holds the broker's only worker; the pool moves it (docs/pool.md)."""
    import keras

    from tests.service import service

    features = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
    targets = features.sum(axis=1, keepdims=True)
    with service(workers=1) as (address, _):
        train = zloader.tf.dataset(Pipeline.from_arrays((features, targets)).batch(16),
                                   broker=address, timeout=30)
        validation = zloader.tf.dataset(
            Pipeline.from_arrays((features[:32], targets[:32])).batch(16), broker=address,
            timeout=30)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        try:
            history = model.fit(train, validation_data=validation, epochs=2, verbose=0)
        finally:
            zloader.tf.close(train)
            zloader.tf.close(validation)
    assert len(history.history["loss"]) == 2 and len(history.history["val_loss"]) == 2


RANK_SCRIPT = """
import json, os, sys
import torch.distributed as dist
import zloader.torch
from zloader import Pipeline

dist.init_process_group("gloo")
drop_last = sys.argv[1] == "drop"
pipeline = Pipeline.range(101, split_size=4)
if sys.argv[1] == "mix":  # (inputs of 6,000, 3,000 and 1,000 in 60, 3 and 1 splits)
    pipeline = Pipeline.mix([Pipeline.range(k * 100_000, k * 100_000 + n, split_size=s)
                             for k, (n, s) in enumerate([(6000, 100), (3000, 1000),
                                                         (1000, 1000)])],
                            [0.6, 0.3, 0.1], seed=3)
dataset = zloader.torch.IterableDataset(pipeline, num_workers=1 + (sys.argv[1] == "mix"),
                                        drop_last=drop_last, timeout=60,
                                        coordinated=sys.argv[1] == "coord")
epochs = [[int(x) for x in dataset] for _ in range(2)]
stats = dataset.stats()
dataset.close()
dist.barrier()
dist.destroy_process_group()
print(json.dumps({"epochs": epochs, "padded": stats.get("padded", 0),
                  "dropped": stats["dropped"]}))
"""


def run_ranks(mode: str) -> list[dict]:
    import json
    import os
    import subprocess
    import sys

    from tests.service import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, mode],
                              env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pad", "drop"])
def test_two_ranks_split_one_epoch_with_equal_counts(mode):
    ranks = run_ranks(mode)
    for epoch in range(2):
        a, b = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        assert len(a) == len(b)  # equal counts: no rank waits on an unequal last step
        if mode == "drop":
            assert not set(a) & set(b)  # no overlap
            assert len(set(a) | set(b)) == 2 * len(a)
        else:
            assert set(a) | set(b) == set(range(101))  # nothing lost; padding repeats
    padded = sum(r["padded"] for r in ranks)
    dropped = sum(r["dropped"] for r in ranks)
    yielded = sum(len(r["epochs"][e]) for r in ranks for e in range(2))
    # Workers deal round-robin, so shares differ by at most one element per worker (two
    # workers here): at most 2 dropped or padded per epoch; 101 is odd, so at least 1.
    if mode == "drop":  # every element is either yielded once or counted as dropped
        assert padded == 0 and yielded + dropped == 2 * 101 and 2 <= dropped <= 4
    else:  # every element is yielded, plus the counted padding
        assert dropped == 0 and yielded == 2 * 101 + padded and 2 <= padded <= 4


@pytest.mark.slow
def test_two_ranks_each_draw_a_mix_with_its_weights_in_every_window():
    # Under torch.distributed the ranks split one balanced job; each draws the mix from
    # what it is dealt, so every rank's stream holds the weights (with 2 workers and an
    # input in one split, drawn on the workers, windows held 0-15% of the 10% input).
    from bench.mix_windows import chi_square_p

    ranks = run_ranks("mix")
    for epoch in range(2):
        a, b = (rank["epochs"][epoch] for rank in ranks)
        assert set(a) | set(b) == {
            k * 100_000 + i for k, n in enumerate([6000, 3000, 1000]) for i in range(n)}
        assert len(a) == len(b)  # (a rank short of the other repeats its last: counted)
    yielded = sum(len(epoch) for rank in ranks for epoch in rank["epochs"])
    assert yielded == 2 * 10_000 + sum(rank["padded"] for rank in ranks)
    epochs = [rank["epochs"][0] for rank in ranks]
    for epoch in epochs:
        inputs = [v // 100_000 for v in epoch]
        for start in range(0, 4000, 1000):
            counts = [inputs[start:start + 1000].count(k) for k in range(3)]
            assert chi_square_p(counts, [0.6, 0.3, 0.1]) >= 0.001, (start, counts)


@pytest.mark.slow
def test_coordinated_ranks_step_on_one_round_with_equal_counts():
    ranks = run_ranks("coord")
    for epoch in range(2):
        a, b = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        assert len(a) == len(b) >= 45  # equal counts, from num_consumers = world size
        assert not set(a) & set(b)
        # A round is two consecutive elements of one worker: mostly (2i, 2i+1) of a split
        # of 4; a worker's last split (one element) pairs with its next split's first.
        assert sum(y == x + 1 for x, y in zip(a, b, strict=True)) >= len(a) - 3
    dropped = ranks[0]["dropped"]
    assert dropped == ranks[1]["dropped"]  # the job's count, seen by every rank
    assert sum(len(r["epochs"][e]) for r in ranks for e in range(2)) + dropped == 2 * 101


@pytest.mark.slow
def test_tf_close_of_a_derived_dataset_stops_its_workers_and_frees_its_rings():
    import os

    import psutil

    from tests.service import wait_for

    def segments() -> list[str]:  # (this process's: tests run two at a time)
        return [name for name in os.listdir("/dev/shm")
                if name.startswith("zloader-") and name.split("-")[2:3] == [str(os.getpid())]]

    ds = zloader.tf.dataset(Pipeline.range(40).batch(4), num_workers=2, timeout=30)
    derived = ds.map(lambda x: x * 2).prefetch(2)
    try:
        assert sum(len(b) for b in derived.as_numpy_iterator()) == 40
        assert psutil.Process().children() and segments()
        zloader.tf.close(derived)
        wait_for(lambda: not psutil.Process().children() and not segments(), timeout=10,
                 what="the workers and rings of the dataset behind the derived one to go")
    finally:
        zloader.tf.close(ds)
