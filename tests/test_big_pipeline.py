"""Pipelines of any size: an ImageNet-sized map-style dataset (a torchvision ``ImageFolder``
keeps 1.28 M ``(path, class)`` tuples) runs in the torch drop-in, embedded and through a
broker, with torch's batches; forked workers never pickle it; a host fetches a large
pipeline once."""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time

import numpy as np
import pytest
import torch

import zloader.torch as zt
from bench.big_dataset import Folder
from tests.service import service, start_broker, start_worker, status, stop, wait_for
from zloader import Loader, Pipeline

BATCHES = 12  # compared with torch's, batch by batch


@pytest.fixture(scope="module")
def folder() -> Folder:
    return Folder()


def _torch_batches(dataset, count: int, **kwargs) -> list:
    loader = torch.utils.data.DataLoader(dataset, batch_size=256, **kwargs)
    return [(x.numpy(), y.numpy()) for x, y in itertools.islice(loader, count)]


def _as_torch_would(dataset, batches) -> list:
    """Torch's batch of the same 256 indices as each of ``batches`` (whose order follows
    zloader's workers): the first index is in the path digits each item carries."""
    expected = []
    for x, _ in batches:
        start = int(bytes(np.asarray(x)[0]).decode())
        batch = torch.utils.data.default_collate([dataset[i] for i in range(start,
                                                                             start + 256)])
        expected.append((batch[0].numpy(), batch[1].numpy()))
    return expected


def _same(ours, theirs) -> None:
    assert len(ours) == len(theirs)
    for (x, y), (tx, ty) in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(x), tx)
        np.testing.assert_array_equal(np.asarray(y), ty)


def test_imagenet_sized_dataset_runs_in_the_torch_drop_in(folder):
    expected = _torch_batches(folder, BATCHES, shuffle=True,
                              generator=torch.Generator().manual_seed(7))
    loader = zt.DataLoader(folder, batch_size=256, num_workers=2, shuffle=True,
                           generator=torch.Generator().manual_seed(7))
    try:
        batches = iter(loader)
        got = [(x.numpy(), y.numpy()) for x, y in itertools.islice(batches, BATCHES)]
        del batches
    finally:
        loader.close()
    _same(got, expected)


def test_imagenet_sized_dataset_runs_embedded(folder):
    pipeline = Pipeline.from_torch(folder, split_size=4096).batch(256)
    with Loader(pipeline, num_workers=2) as loader:
        got = list(itertools.islice(iter(loader), BATCHES))
        assert loader.stats()["served"] == {}  # inherited by fork: nothing fetched
    _same(got, _as_torch_would(folder, got))


# slow: the embedded and drop-in runs of the same dataset, and the large pipeline's fetch
# (test_a_host_fetches_a_large_pipeline_once), stay in the fast suite
@pytest.mark.slow
def test_imagenet_sized_dataset_runs_through_a_broker(folder):
    pipeline = Pipeline.from_torch(folder, split_size=4096).batch(256)
    with service(workers=1) as (address, _), Loader(pipeline, broker=address) as loader:
        got = list(itertools.islice(iter(loader), BATCHES))
        assert loader.stats()["served"] == {"pipeline": 1}  # not through the broker
    _same(got, _as_torch_would(folder, got))


@pytest.mark.filterwarnings("ignore::zloader.errors.FingerprintWarning")
def test_forked_workers_run_a_pipeline_that_cannot_be_pickled():
    lock = threading.Lock()  # cloudpickle refuses it; torch's forked workers never try

    def keep(x: int) -> int:
        with lock:
            return x * 2

    pipeline = Pipeline.range(100).map(keep)
    with Loader(pipeline, num_workers=2) as loader:
        assert sorted(loader) == [x * 2 for x in range(100)]
    with pytest.raises(Exception, match="lock"):
        Loader(pipeline, num_workers=1, start_method="spawn")


def test_a_host_fetches_a_large_pipeline_once():
    table = np.random.default_rng(0).integers(0, 1 << 30, 600_000)  # 4.8 MB in the closure
    def look_up(i: int) -> int:
        time.sleep(0.01)  # so that both processes get splits, the second one loading it late
        return int(table[i])

    pipeline = Pipeline.range(64, split_size=4).map(look_up)
    broker, address = start_broker()
    workers = start_worker(address, processes=2)
    try:
        wait_for(lambda: len((status(address, 1.0) or {}).get("workers", ())) == 2,
                 what="two worker processes")
        with Loader(pipeline, broker=address) as loader:
            for _ in range(2):
                assert sorted(loader) == sorted(int(v) for v in table[:64])
            assert len(loader.stats()["per_worker"]) == 2  # both processes ran it
            # one fetch for the host's two processes and both epochs
            assert loader.stats()["served"] == {"pipeline": 1}
    finally:
        stop(workers)
        stop(broker)


class _Finalized:
    """Writes the pid of the process that finalizes it to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.cycle = self  # only the cycle collector frees it

    def __del__(self) -> None:
        with open(self.path, "a") as file:
            file.write(f"{os.getpid()}\n")


def _collect(x: int) -> int:
    gc.collect()
    return x


def test_forked_workers_never_finalize_the_parents_garbage(tmp_path):
    """Garbage the parent had not collected when it forked (a cycle of TensorFlow objects
    after a keras fit, say) must not be finalized in a worker: a TF object's finalizer
    aborts a forked process. The workers collect; only the parent finalizes it."""
    path = str(tmp_path / "finalized")
    gc.disable()
    try:
        _Finalized(path)  # garbage at once, kept until a collection
        with Loader(Pipeline.range(8).map(_collect), num_workers=2, timeout=30) as loader:
            assert sorted(loader) == list(range(8))
            workers = set(loader.stats()["per_worker"])
    finally:
        gc.enable()
    gc.collect()
    with open(path) as file:
        finalizers = file.read().split()
    assert workers and finalizers == [str(os.getpid())]
