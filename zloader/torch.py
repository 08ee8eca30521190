"""PyTorch adapters: a drop-in ``DataLoader`` and an ``IterableDataset`` over a Pipeline.

This module is the only one in zloader that imports torch; import it explicitly
(``import zloader.torch``).

:class:`DataLoader` takes what ``torch.utils.data.DataLoader`` takes; with ``num_workers > 0``
the batches are made by zloader worker processes and, for map-style datasets, they are the
same batches in the same order as torch's (same sampler draws, same worker seeding, batches
assigned to workers round-robin). :class:`IterableDataset` runs a Pipeline in the iterating
process (give it to a torch ``DataLoader`` with ``num_workers=0, batch_size=None``).

Element conversion (:func:`to_torch`): numpy arrays become tensors that share their memory
(``torch.from_numpy``, no copy) when the array is writable; read-only arrays (rows of
``Pipeline.from_arrays``, elements decoded from read-only memory) are copied, so that
writing to a tensor can never change data the pipeline owns. Numpy scalars become 0-d
tensors; containers keep their shape; everything else is passed through.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import math
import os
import queue
import random
import secrets
import struct
import threading
import warnings
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.utils.data
from torch.utils.data._utils import collate as _torch_collate
from torch.utils.data._utils import worker as _torch_worker

from zloader import _check, codec
from zloader._defaults import PREFETCH_STOP_SECONDS, STACK_LATER_BYTES
from zloader.errors import PipelineError
from zloader.loader import Loader
from zloader.pipeline import Pipeline
from zloader.sources import Source

__all__ = ["DataLoader", "IterableDataset", "to_numpy", "to_torch"]


def to_torch(element: Any) -> Any:
    """Convert the numpy arrays and scalars in a nested element to tensors."""
    if isinstance(element, np.ndarray):
        if not element.flags.writeable:
            element = element.copy()
        return torch.from_numpy(element)
    if isinstance(element, np.generic) and not isinstance(element, (str, bytes)):
        return torch.from_numpy(np.asarray(element).copy())
    if isinstance(element, dict):
        return {key: to_torch(value) for key, value in element.items()}
    if isinstance(element, tuple) and hasattr(element, "_fields"):
        return type(element)(*(to_torch(value) for value in element))
    if isinstance(element, (list, tuple)):
        return type(element)(to_torch(value) for value in element)
    return element


class IterableDataset(torch.utils.data.IterableDataset):
    """A torch ``IterableDataset`` of a Pipeline's elements as tensors, read from zloader
    workers; one iteration is one epoch. Give it to ``DataLoader(ds, batch_size=None,
    num_workers=0)`` (batching belongs in the pipeline) or iterate it directly.

    Args:
        pipeline: the pipeline.
        **loader_kwargs: passed to :class:`zloader.Loader` (``num_workers``, ``broker``,
            ``job_name``, ``sharding``...). ``num_workers=0`` without a broker runs the
            pipeline in the iterating process instead. The Loader starts on the first
            iteration; :meth:`close` (or garbage collection) stops it.
        coordinated: under ``torch.distributed`` (world size > 1), read in coordinated
            rounds (``Loader(num_consumers=world size, consumer_index=rank)``, see
            docs/coordinated.md): every rank's batch of a step comes from one round, so
            with ``bucket_by_length`` all ranks step on batches of one bucket (a given
            ``job_name`` is used, else one is derived). Without it the ranks split the job
            by dealing elements one at a time. Ignored outside ``torch.distributed``.

    Reading from workers, it runs one epoch at a time: a new ``iter()`` ends the
    iterator of the epoch under way (as torch's DataLoader with persistent workers does).

    Raises:
        TypeError: ``pipeline`` is not a Pipeline.
        RuntimeError: iterated inside a torch DataLoader worker (``num_workers > 0``),
            where every torch worker would yield the whole pipeline.
    """

    def __init__(self, pipeline: Pipeline, *, drop_last: bool = False,
                 coordinated: bool = False, **loader_kwargs: Any) -> None:
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"pipeline must be a zloader.Pipeline, got {type(pipeline).__name__}")
        self.pipeline = pipeline
        self.loader_kwargs = loader_kwargs
        self.drop_last = _check.boolean("drop_last", drop_last)
        self.coordinated = _check.boolean("coordinated", coordinated)
        self._next_epoch = 0
        self._loader: Loader | None = None
        self._live: weakref.ref[Generator[Any, None, None]] | None = None
        self._ranks: _Ranks | None = None
        self._broker: Any = None
        self._counted = {"padded": 0, "dropped": 0}
        if loader_kwargs.get("share") and _distributed():
            raise ValueError(
                "share=True gives every trainer every element; under torch.distributed "
                "(world size > 1) the ranks of one run split one job instead. share is for "
                "independent trainers over the same pipeline (hyper-parameter searches)")
        if coordinated and {"num_consumers", "consumer_index"} & set(loader_kwargs):
            raise ValueError("coordinated=True takes num_consumers and consumer_index from "
                             "torch.distributed; pass them to the Loader only without it")
        if _distributed() and (coordinated
                               or not ({"job_name", "sharding"} & set(loader_kwargs))):
            self._ranks = _Ranks()
            self._join_ranks()
        self._in_process = (self._ranks is None and loader_kwargs.get("num_workers") == 0
                            and loader_kwargs.get("broker") is None)

    def _join_ranks(self) -> None:
        """Under torch.distributed: one job for all ranks, on the caller's broker or on one
        that rank 0 starts (single host), named from the fingerprint and this run."""
        ranks = self._ranks
        assert ranks is not None
        from zloader.broker import Broker

        address = self.loader_kwargs.get("broker")
        if address is None and ranks.rank == 0:
            self._broker = Broker("tcp://127.0.0.1:0").start()
            address = self._broker.endpoint
        run = os.environ.get("TORCHELASTIC_RUN_ID") or secrets.token_hex(8)
        address, run = ranks.broadcast([address, run])
        workers = self.loader_kwargs.get("num_workers")
        if workers is None:
            workers = max(1, (os.cpu_count() or 1) // ranks.world)
        job_name = self.loader_kwargs.get("job_name") or f"{self.pipeline.fingerprint[:16]}-{run}"
        self.loader_kwargs = {**self.loader_kwargs, "broker": address, "num_workers": workers,
                              "job_name": job_name}
        if self.coordinated:  # rounds give every rank as many elements
            self.loader_kwargs.update(num_consumers=ranks.world, consumer_index=ranks.rank)
        else:
            self.loader_kwargs["balanced"] = ranks.world

    def state_dict(self) -> dict[str, Any]:
        """The Loader's :meth:`zloader.Loader.state_dict` (where this epoch stands); give
        it to :meth:`load_state_dict` of a new dataset to resume.

        Raises:
            ValueError: no epoch has started yet, or the Loader cannot record one (see
                :meth:`zloader.Loader.state_dict`; ranks of ``torch.distributed`` are
                balanced or coordinated, which it does not record).
        """
        if self._loader is None:
            raise ValueError("state_dict() before the first iteration: nothing to record")
        return self._loader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        """Resume from :meth:`state_dict` (or a list of them, one per Loader of a
        ``job_name``) on the first iteration.

        Raises:
            RuntimeError: the dataset has already started its Loader.
        """
        if self._loader is not None:
            raise RuntimeError("load_state_dict() must come before the first iteration")
        self.loader_kwargs["state"] = state
        if isinstance(state, dict) and isinstance(state.get("epoch"), int):
            self._next_epoch = state["epoch"]

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run ``epoch`` (as with ``DistributedSampler``); epochs
        only move forward.

        Raises:
            ValueError: ``epoch`` was already run.
        """
        epoch = _check.integer("epoch", epoch, 0)
        if epoch < self._next_epoch:
            raise ValueError(f"epoch {epoch} was already run (the next is "
                             f"{self._next_epoch}); epochs only move forward")
        self._next_epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError(
                "zloader.torch.IterableDataset runs on zloader's own workers: inside a torch "
                "DataLoader with num_workers > 0 every torch worker would yield every "
                "element. Use DataLoader(dataset, num_workers=0, batch_size=None) and put "
                "batching in the pipeline.")
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        if self._in_process:
            return (to_torch(element) for element in self.pipeline.iter(epoch))
        self._end_live()
        if self._loader is None:
            self._loader = Loader(self.pipeline, **self.loader_kwargs)
        self._loader.set_epoch(epoch)
        elements = (to_torch(element) for element in self._loader)
        if self._ranks is not None and not self.coordinated:
            elements = self._lockstep(elements)
        self._live = weakref.ref(elements)
        return elements

    def _end_live(self) -> None:
        """End the iterator of the epoch under way, if any: the Loader runs one epoch at a
        time (as torch's DataLoader with persistent workers, a new ``iter()`` ends the
        older iterator; two read at once would take each other's elements)."""
        live = self._live() if self._live is not None else None
        self._live = None
        if live is not None:
            # (ValueError: it is running on another thread, and cannot be ended from here)
            with contextlib.suppress(ValueError):
                live.close()

    def _lockstep(self, elements: Iterator[Any]) -> Generator[Any, None, None]:
        """Equal counts on every rank: each step, the ranks tell each other whether they
        still have an element. With ``drop_last`` all stop when one runs out (the others
        drop the rest of their share); otherwise the ranks that ran out repeat their last
        element until all have (as ``DistributedSampler`` pads). Both are counted."""
        ranks = self._ranks
        assert ranks is not None
        last: Any = _NONE
        while True:
            element = next(elements, _NONE)
            having = ranks.count(element is not _NONE)
            if having == 0:
                return
            if having < ranks.world and self.drop_last:
                dropped = int(element is not _NONE) + sum(1 for _ in elements)
                self._counted["dropped"] += dropped
                return
            if element is _NONE:
                if last is _NONE:
                    raise RuntimeError(
                        "this rank received no element to pad with while other ranks have "
                        "data; use drop_last=True for inputs smaller than the world size")
                self._counted["padded"] += 1
                yield last
                continue
            last = element
            yield element

    def stats(self) -> dict[str, Any]:
        """The Loader's :meth:`~zloader.Loader.stats` (empty before the first iteration),
        plus ``padded`` and ``dropped`` under torch.distributed (without ``coordinated``,
        whose ``dropped`` is the Loader's)."""
        base = self._loader.stats() if self._loader is not None else {}
        if self._ranks is None or self.coordinated:
            return base
        return {**base, **self._counted}

    def close(self) -> None:
        """Stop the Loader and its workers (and, on rank 0, the broker it started)."""
        loader = self.__dict__.get("_loader")
        if loader is not None:
            loader.close()
            self._loader = None
        broker = self.__dict__.get("_broker")
        if broker is not None:
            broker.close()
            self._broker = None

    def __del__(self) -> None:
        self.close()


_NONE = object()


def _distributed() -> bool:
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


class _Ranks:
    """The collectives the dataset needs, on a gloo group of its own (works beside NCCL)."""

    def __init__(self) -> None:
        dist = torch.distributed
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.group = dist.new_group(backend="gloo")

    def broadcast(self, values: list[Any]) -> list[Any]:
        torch.distributed.broadcast_object_list(values, src=0, group=self.group)
        return values

    def count(self, flag: bool) -> int:
        tensor = torch.tensor([int(flag)], dtype=torch.int64)
        torch.distributed.all_reduce(tensor, group=self.group)
        return int(tensor.item())


def to_numpy(element: Any) -> Any:
    """Convert the tensors in a nested element to numpy arrays (sharing memory), so that
    the codec can carry them."""
    if isinstance(element, torch.Tensor):
        tensor = element.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if tensor.dtype == torch.bfloat16:
            raise TypeError("bfloat16 tensors cannot cross zloader's codec yet; convert them "
                            "to float32 in collate_fn")
        return tensor.numpy()
    if isinstance(element, dict):
        return {key: to_numpy(value) for key, value in element.items()}
    if isinstance(element, list):
        return [to_numpy(v) for v in element]
    if isinstance(element, tuple):  # named tuples too: the codec carries them as tuples
        return tuple(to_numpy(v) for v in element)
    return element


# --- the drop-in DataLoader ---------------------------------------------------------------

@dataclass
class _Seeded:
    """This worker process's seeding for the DataLoader whose batches it makes (a worker
    runs one task at a time): that loader's token, and the random state it last reported."""

    token: str
    reported: bytes


_SEEDED: _Seeded | None = None


@dataclass(frozen=True, eq=False, kw_only=True)
class _BatchSource(Source):
    """Worker ``w`` of ``width`` makes batches ``w, w + width, ...`` of the epoch the
    consumer sampled (map-style), or runs the iterable dataset as torch worker ``w``."""

    kind: ClassVar[str] = "torch_dataloader"
    dataset: Any
    collate_fn: Callable[[list[Any]], Any] | None
    worker_init_fn: Callable[[int], None] | None
    persistent: bool
    width: int
    iterable: bool
    batch_size: int | None
    drop_last: bool
    token: str

    @property
    def num_splits(self) -> int:
        return self.width

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.token)  # this loader's job alone; the dataset is not hashed

    def read(self, split: int, policy: Any = None) -> Iterator[Any]:
        plan = getattr(policy, "epoch_input", None)
        if not isinstance(plan, dict):
            raise RuntimeError("a torch DataLoader epoch reached a worker without its plan")
        worker = int(getattr(policy, "worker", 0))
        global _SEEDED
        if plan["reseed"] or _SEEDED is None or _SEEDED.token != self.token:
            _seed_worker(int(plan["seed"]), worker, self.width, self.dataset,
                         self.worker_init_fn)
            resumed = plan.get("rng")
            if resumed and resumed[worker]:  # load_state_dict: as this worker was then
                _restore_rng(bytes(resumed[worker]))
            _SEEDED = _Seeded(self.token, _capture_rng())
        if self.iterable:
            return self._iterable(worker)
        return self._mapped(plan, worker, _SEEDED)

    def _mapped(self, plan: dict[str, Any], worker: int, seeded: _Seeded) -> Iterator[Any]:
        """This worker's batches ``j`` (``j mod width == worker``) of the epoch, from batch
        ``first`` on, each as ``(j, random state after it or b"" if unchanged, batch)``:
        the consumer keeps the state of the last batch it yielded, for ``state_dict``."""
        flat, offsets, first = plan["flat"], plan["offsets"], int(plan.get("first", 0))
        for batch in range((worker - first) % self.width, len(offsets) - 1, self.width):
            indices = flat[offsets[batch]:offsets[batch + 1]]
            keys = indices.tolist() if isinstance(indices, np.ndarray) else list(indices)
            made = to_numpy(self._collate([self._get(i) for i in keys]) if plan["batched"]
                            else self._collate_one(self._get(keys[0])))
            state = _capture_rng()
            changed, seeded.reported = state != seeded.reported, state
            yield (first + batch, state if changed else b"", made)

    def _iterable(self, worker: int) -> Iterator[Any]:
        iterator = iter(self.dataset)
        if self.batch_size is None:
            for sample in iterator:
                yield to_numpy(self._collate_one(sample))
            return
        while True:
            samples = [s for _, s in zip(range(self.batch_size), iterator, strict=False)]
            if not samples or (self.drop_last and len(samples) < self.batch_size):
                return
            yield to_numpy(self._collate(samples))

    def _get(self, index: Any) -> Any:
        try:
            return self.dataset[index]
        except BaseException as exc:  # SystemExit too: the consumer must hear of it
            raise PipelineError.from_exception(exc, "dataset", f"index {index!r}") from exc

    def _collate(self, samples: list[Any]) -> Any:
        if self.collate_fn is not None:
            try:
                return self.collate_fn(samples)
            except Exception as exc:
                raise PipelineError.from_exception(exc, "collate_fn") from exc
        # torch's default collate stacks into a fresh shared-memory segment when it sees a
        # worker (to hand the batch to its parent). zloader moves the batch itself: large
        # tensors are left unstacked (codec.Stacked) and copied once, straight into the
        # consumer's ring; the rest is stacked into ordinary memory. Same values.
        info, _torch_worker._worker_info = _torch_worker._worker_info, None
        try:
            return _torch_collate.collate(samples, collate_fn_map=_COLLATE_MAP)
        except Exception as exc:
            raise PipelineError.from_exception(exc, "collate_fn") from exc
        finally:
            _torch_worker._worker_info = info

    def _collate_one(self, sample: Any) -> Any:
        convert = self.collate_fn or torch.utils.data.default_convert
        try:
            return convert(sample)
        except Exception as exc:
            raise PipelineError.from_exception(exc, "collate_fn") from exc


def _stack_later(batch: list[Any], *, collate_fn_map: Any = None) -> Any:
    """Torch's tensor collate, except that a large batch of equal, plain CPU tensors becomes
    a :class:`codec.Stacked` of their memory (the stack happens in the record's copy)."""
    elem = batch[0]
    if (type(elem) is torch.Tensor and elem.layout == torch.strided and not elem.is_nested
            and elem.device.type == "cpu" and elem.dtype in _NUMPY_DTYPES
            and elem.numel() * elem.element_size() * len(batch) >= STACK_LATER_BYTES
            and all(type(t) is torch.Tensor and t.dtype == elem.dtype and t.shape == elem.shape
                    and t.device == elem.device for t in batch)):
        rows = [t.detach().resolve_conj().resolve_neg().contiguous().numpy() for t in batch]
        return codec.Stacked(rows)
    return _torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


_NUMPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.float16, torch.float32, torch.float64, torch.complex64,
                 torch.complex128}
_COLLATE_MAP = {**_torch_collate.default_collate_fn_map, torch.Tensor: _stack_later}


def _seed_worker(base_seed: int, worker: int, workers: int, dataset: Any,
                 init_fn: Callable[[int], None] | None) -> None:
    """Seed this worker exactly as torch seeds its worker ``worker`` (``_worker_loop``)."""
    torch.set_num_threads(1)
    seed = base_seed + worker
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_torch_worker._generate_state(base_seed, worker))
    _torch_worker._worker_info = _torch_worker.WorkerInfo(
        id=worker, num_workers=workers, seed=seed, dataset=dataset)
    if init_fn is not None:
        init_fn(worker)


def _capture_rng() -> bytes:
    """This process's torch, numpy and ``random`` global random states, packed: what a
    worker's dataset draws from (torch seeds all three in its workers)."""
    torch_state = torch.get_rng_state().numpy().tobytes()
    _, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, words, py_gauss = random.getstate()
    return b"".join([
        _RNG_HEAD.pack(len(torch_state)), torch_state,
        np.asarray(keys, dtype="<u4").tobytes(), _NP_TAIL.pack(pos, has_gauss, gauss),
        np.asarray(words, dtype="<u4").tobytes(),
        _PY_TAIL.pack(version, py_gauss is not None, py_gauss or 0.0)])


def _unpack_rng(data: bytes) -> tuple[bytes, tuple[Any, ...], tuple[Any, ...]]:
    """The three states :func:`_capture_rng` packed: (torch, numpy, random).

    Raises:
        ValueError: ``data`` is not such a packing (a corrupt or foreign state_dict).
    """
    try:
        (size,) = _RNG_HEAD.unpack_from(data, 0)
        at = _RNG_HEAD.size
        torch_state, at = data[at:at + size], at + size
        keys, at = np.frombuffer(data, "<u4", _MT_WORDS, at), at + 4 * _MT_WORDS
        pos, has_gauss, gauss = _NP_TAIL.unpack_from(data, at)
        at += _NP_TAIL.size
        words, at = np.frombuffer(data, "<u4", _MT_WORDS + 1, at), at + 4 * (_MT_WORDS + 1)
        version, has_py_gauss, py_gauss = _PY_TAIL.unpack_from(data, at)
        if (at + _PY_TAIL.size != len(data) or len(torch_state) != size
                or size != torch.get_rng_state().numel()):
            raise ValueError("wrong length")
    except (ValueError, struct.error) as exc:
        raise ValueError(f"not a worker random state saved by zloader.torch.DataLoader "
                         f"({exc})") from None
    return (torch_state,
            ("MT19937", keys.astype(np.uint32), pos, has_gauss, gauss),
            (version, tuple(int(w) for w in words), py_gauss if has_py_gauss else None))


def _restore_rng(data: bytes) -> None:
    """Set this process's torch, numpy and ``random`` states to a :func:`_capture_rng`."""
    torch_state, numpy_state, py_state = _unpack_rng(data)
    torch.set_rng_state(torch.frombuffer(bytearray(torch_state), dtype=torch.uint8))
    np.random.set_state(numpy_state)
    random.setstate(py_state)


_RNG_HEAD = struct.Struct("<I")
_NP_TAIL = struct.Struct("<iid")
_PY_TAIL = struct.Struct("<i?d")
_MT_WORDS = 624


class DataLoader:
    """``torch.utils.data.DataLoader`` with zloader's workers: change the import, keep the
    arguments.

    ``num_workers=0`` loads in this process, exactly as torch does. ``num_workers > 0`` makes
    batches on zloader worker processes (embedded, or the broker's). For a map-style
    dataset the batches are torch's: this loader samples indices with torch's own sampler,
    draws the base seed from ``generator`` as torch does, seeds worker ``i`` with ``base
    seed + i`` (afresh each epoch unless ``persistent_workers``), gives batch ``j`` to
    worker ``j mod num_workers`` and yields batches in order. Iterable datasets see
    ``torch.utils.data.get_worker_info()`` in each worker, so self-sharding keeps working.

    Iterators behave as torch's. Without ``persistent_workers`` each ``iter()`` is a pass
    of its own, with its own workers, which take the dataset as it is at that ``iter()``
    (changes made between epochs are seen) and stop when the pass ends or its iterator is
    dropped; two live iterators are two independent passes. With ``persistent_workers``
    the workers (and the dataset copy they took) last until :meth:`close`, and, as in
    torch, there is one iterator: ``iter()`` returns it, restarted at a new epoch. (An
    epoch left early leaves persistent workers' random states where they had got to, which
    may be further than torch's had: the next epoch samples as torch does, but random
    augmentations in the dataset may then differ from torch's.)

    Args:
        dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
        pin_memory, drop_last, timeout, worker_init_fn, prefetch_factor,
        persistent_workers, generator: as in torch. ``timeout=0`` means no per-batch
            limit, but a dead or silent worker set still raises (after 60 s).
        broker: a zloader broker address: ``num_workers`` of the broker's workers (wherever
            they run; this process starts none) make the batches, as torch's workers
            ``0 .. num_workers - 1`` would. A pass waits for that many to be free (and
            raises after ``timeout``, or 60 s, without them). Needs ``num_workers > 0``.
        share: not available here (raises ValueError): share a Pipeline through
            :class:`IterableDataset` (``share=True``) instead.
        job_name: a name for the broker's job (shown by ``zloader status``); without
            ``persistent_workers`` each pass is a job of its own, ``job_name.N``.
        device: move each batch to this device (``non_blocking``).

    Raises:
        ValueError: what torch's DataLoader raises for the same arguments; ``broker``
            with ``num_workers=0``.
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Callable[[int], None] | None = None,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 generator: torch.Generator | None = None, *, broker: str | None = None,
                 share: bool = False, job_name: str | None = None,
                 device: str | torch.device | None = None) -> None:
        self._service: Loader | None = None  # persistent_workers: the one Loader
        self._passes: weakref.WeakSet[_Pass] = weakref.WeakSet()  # live iterators
        if isinstance(timeout, float) and not math.isfinite(timeout):
            raise ValueError(f"timeout must be a finite number of seconds (0: no per-batch "
                             f"limit), got {timeout!r}")
        if share:
            raise ValueError(
                "share=True is not available for zloader.torch.DataLoader: its batches "
                "follow this loader's own sampler and seeds, so no other trainer's match. "
                "Share a zloader.Pipeline instead: zloader.torch.IterableDataset(pipeline, "
                "share=True, broker=...)")
        # torch validates every argument and builds the sampler and collate function.
        self._torch = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
            batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
            pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
            worker_init_fn=worker_init_fn, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers, generator=generator)
        if broker is not None and num_workers == 0:
            raise ValueError(
                "broker= needs num_workers > 0: num_workers=0 loads in this process, as "
                "torch does; pass num_workers=N to have N of the broker's workers make the "
                "batches")
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.timeout = timeout
        self.device = torch.device(device) if device is not None else None
        self._broker = broker
        self._job_name = job_name
        self._prefetch = prefetch_factor or 2
        self._persistent = persistent_workers
        self._iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        self._base_seed: int | None = None
        self._progress: _Progress | None = None  # the latest pass's
        self._iterator: weakref.ref[_Pass] | None = None  # persistent_workers: the one
        self._started = 0  # passes started (names the jobs of passes on a broker)
        self._resume: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._torch, name)  # dataset, batch_size, sampler, generator, ...

    def __len__(self) -> int:
        return len(self._torch)

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        skip = 0
        workers: dict[int, bytes] = {}
        if resume is not None:  # load_state_dict: sample that epoch again, skip what was had
            self._set_rng(resume["rng"])
            skip = resume["batches"]
            if resume["base_seed"] is not None:
                self._base_seed = resume["base_seed"]
            workers = resume["workers"]
        iterator = self._iterator() if self._iterator is not None else None
        if iterator is not None:
            iterator.end_epoch()  # before the next starts: the Loader reads one at a time
            iterator.restart(*self._start(skip, workers))
            return iterator
        iterator = _Pass(self, *self._start(skip, workers))
        self._passes.add(iterator)
        if self._persistent:
            self._iterator = weakref.ref(iterator)
        return iterator

    def _start(self, skip: int, resumed: dict[int, bytes]
               ) -> tuple[Iterator[Any], _Progress, Loader | None, _Sampling | None]:
        """Start a pass (an epoch) at batch ``skip``: its batches, its progress, the
        Loader that is its own (None: no workers, or the persistent one) and its
        sampling (None: torch's own iterator, an iterable dataset or an eager sampler)."""
        previous = self._progress
        progress = _Progress(rng=self._rng(), yielded=skip)
        self._progress = progress
        if self.num_workers == 0:
            return itertools.islice(iter(self._torch), skip, None), progress, None, None
        plan, sampling = self._plan(skip)
        if resumed:
            plan["rng"] = [resumed.get(w, b"") for w in range(self.num_workers)]
            progress.workers = dict(resumed)
        elif not plan["reseed"] and previous is not None:  # workers go on where they are
            progress.workers = dict(previous.workers)
        own = None
        if self._persistent:
            if self._service is None:
                self._service = self._loader()
            loader = self._service
        else:
            loader = own = self._loader()
        progress.loader = loader
        try:
            records = loader.iterate(plan)
        except BaseException:
            if own is not None:
                own.close()
            raise
        batches = records if self._iterable else _in_order(records, skip, progress,
                                                           self.num_workers)
        return (self._deliver(to_torch(batch) for batch in batches), progress, own,
                sampling)

    def _plan(self, skip: int) -> tuple[dict[str, Any], _Sampling | None]:
        """What the workers get for an epoch: its sampled batches from ``skip`` on (none
        for an iterable dataset) and the base seed; drawn in torch's order: make the
        sampler iterator, draw the base seed, then sample."""
        torch_loader = self._torch
        before = self._rng()
        indices = None if self._iterable else iter(torch_loader._index_sampler)
        eager = self._rng() != before  # a sampler that samples when its iterator is made
        reseed = self._base_seed is None or not self._persistent
        if reseed:
            self._base_seed = int(torch.empty((), dtype=torch.int64)
                                  .random_(generator=torch_loader.generator).item())
        plan: dict[str, Any] = {}
        sampling = None
        if indices is not None:
            if eager or not _draws_only_from(torch_loader._index_sampler,
                                             torch_loader.generator):
                sampled = list(indices)
            else:
                sampling = _Sampling(self, indices, self._prefetch * self.num_workers + skip)
                sampled = sampling.batches
            plan = _pack(sampled[skip:], torch_loader._auto_collation)
        plan.update(seed=self._base_seed, reseed=reseed, first=skip)
        return plan, sampling

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is, as a small JSON-serializable dict: the random state its
        latest pass sampled from, the batches it yielded and its workers' random states
        (torch, numpy and ``random``) after the last of them. ``load_state_dict`` makes the
        next iteration sample that epoch again (same order, same seeds, the workers' random
        states restored) and yield only the batches after those; a finished epoch resumes
        at the next one. Random state the dataset keeps itself (a ``Generator`` object made
        in ``worker_init_fn``) is not recorded.

        Raises:
            ValueError: the dataset is iterable (its position cannot be restored).
        """
        if self._iterable:
            raise ValueError("state_dict() needs a map-style dataset: an iterable dataset's "
                             "position inside its own iterator cannot be restored")
        progress = self._progress
        if progress is None or progress.finished:
            rng, batches = self._rng(), 0
            # The next epoch reseeds the workers, unless they persist.
            workers = progress.workers if progress is not None and self._persistent else {}
        else:
            rng, batches, workers = progress.rng, progress.yielded, progress.workers
        return {"zloader_torch": 1, "rng": rng, "batches": batches,
                "base_seed": self._base_seed,
                "workers": {str(w): base64.b64encode(s).decode()
                            for w, s in sorted(workers.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` on the next iteration. It sets the random state
        the sampler draws from (this loader's ``generator``, or torch's global one) to the
        one that epoch started from, and the workers' to theirs.

        Raises:
            ValueError: ``state`` is not such a dict.
        """
        if not (isinstance(state, dict) and state.get("zloader_torch") == 1
                and isinstance(state.get("rng"), str)
                and isinstance(state.get("batches"), int) and state["batches"] >= 0
                and (state.get("base_seed") is None or isinstance(state["base_seed"], int))
                and isinstance(state.get("workers", {}), dict)):
            raise ValueError("state must be what zloader.torch.DataLoader.state_dict() "
                             "returned")
        workers = {}
        for key, text in state.get("workers", {}).items():
            if not (isinstance(key, str) and key.isdigit() and int(key) < self.num_workers
                    and isinstance(text, str)):
                raise ValueError(f"state['workers'] holds {key!r}: not a worker of this "
                                 f"loader's {self.num_workers} (num_workers must be the "
                                 "saved loader's)")
            try:
                data = base64.b64decode(text, validate=True)
            except ValueError:
                raise ValueError(f"state['workers'][{key!r}] is not base64") from None
            _unpack_rng(data)  # raises on a corrupt one
            workers[int(key)] = data
        self._resume = {**state, "workers": workers}

    def stats(self) -> dict[str, Any]:
        """The :meth:`zloader.Loader.stats` of the latest pass's workers (as they were when
        the pass ended, if it has); empty with ``num_workers=0`` or before the first pass."""
        progress = self._progress
        loader = progress.loader if progress is not None else None
        return loader.stats() if loader is not None else {}

    def _rng(self) -> str:
        generator = self._torch.generator
        state = generator.get_state() if generator is not None else torch.get_rng_state()
        return base64.b64encode(state.numpy().tobytes()).decode()

    def _set_rng(self, text: str) -> None:
        state = torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
        generator = self._torch.generator
        if generator is not None:
            generator.set_state(state)
        else:
            torch.set_rng_state(state)

    def _loader(self) -> Loader:
        """A Loader (worker processes, or a job on the broker's) over the dataset as it is
        now."""
        torch_loader = self._torch
        source = _BatchSource(
            name="dataset", shuffle_splits=False, seed=None, version=None,
            dataset=torch_loader.dataset, collate_fn=self._torch_collate(),
            worker_init_fn=torch_loader.worker_init_fn, persistent=self._persistent,
            width=self.num_workers, iterable=self._iterable,
            batch_size=torch_loader.batch_size if torch_loader._auto_collation else None,
            drop_last=torch_loader.drop_last, token=secrets.token_hex(8))
        self._started += 1
        job_name = self._job_name
        if job_name is not None and not self._persistent:
            job_name = f"{job_name}.{self._started}"  # a pass's job lingers a while
        return Loader(Pipeline(source), broker=self._broker,
                      num_workers=0 if self._broker is not None else self.num_workers,
                      width=self.num_workers, sharding="static", deterministic=True,
                      job_name=job_name, prefetch=self._prefetch,
                      timeout=self.timeout or 60.0)

    def _torch_collate(self) -> Callable[[list[Any]], Any] | None:
        collate = self._torch.collate_fn
        defaults = (torch.utils.data.default_collate, torch.utils.data.default_convert)
        return None if collate in defaults else collate

    def _deliver(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Yield batches; pinned and/or moved to ``device`` ahead of use on a background
        thread when asked (a CUDA copy runs on a side stream and the training loop's stream
        waits for it, so the copy overlaps the previous step)."""
        pin = self.pin_memory and self.num_workers > 0
        if pin and not torch.cuda.is_available():
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                          "then device pinned memory won't be used.", stacklevel=4)
            pin = False
        device = self.device
        if not pin and device is None:
            return batches
        return _Prefetcher(batches, pin, device, depth=self._prefetch)

    def close(self) -> None:
        """Stop the worker processes of every pass (also done when the loader is garbage
        collected); its iterators end."""
        for iterator in list(self.__dict__.get("_passes", ())):
            iterator.close()
        service = self.__dict__.get("_service")
        if service is not None:
            service.close()
            self._service = None

    def __del__(self) -> None:
        self.close()


@dataclass
class _Progress:
    """Where a pass stands: the sampler's random state it started from, the batches it
    yielded (those it skipped when resumed included), and the random state of each worker
    after its last batch yielded (a worker not in it is as seeded)."""

    rng: str
    yielded: int
    finished: bool = False
    workers: dict[int, bytes] = field(default_factory=dict)
    loader: Loader | None = None  # the pass's Loader, for stats()


class _Pass:
    """An iterator of a :class:`DataLoader`: one epoch's batches, counted; with a Loader
    of its own (``persistent_workers=False``), which it closes when the epoch ends, on an
    error, on :meth:`close` or when it is garbage collected."""

    def __init__(self, owner: DataLoader, batches: Iterator[Any], progress: _Progress,
                 loader: Loader | None, sampling: _Sampling | None) -> None:
        self._owner = owner  # the DataLoader lives while its iterators do, as in torch
        self._batches: Iterator[Any] | None = batches
        self._progress = progress
        self._loader = loader
        self._sampling = sampling

    def __iter__(self) -> _Pass:
        return self

    def __len__(self) -> int:
        return len(self._owner)

    def __next__(self) -> Any:
        if self._batches is None:
            raise StopIteration
        try:
            batch = next(self._batches)
        except StopIteration:
            self._progress.finished = True
            self.close()
            raise
        except BaseException:
            self.close()
            raise
        self._progress.yielded += 1
        if self._sampling is not None:
            self._sampling.pull()  # as torch does for each batch it receives
        return batch

    def restart(self, batches: Iterator[Any], progress: _Progress, loader: Loader | None,
                sampling: _Sampling | None) -> None:
        """Go on with a new epoch (``iter()`` of a loader with persistent workers)."""
        self.end_epoch()
        self._batches, self._progress, self._loader = batches, progress, loader
        self._sampling = sampling

    def end_epoch(self) -> None:
        """Stop reading the epoch under way (and the thread that pins its batches)."""
        batches, self._batches = self.__dict__.get("_batches"), None
        close = getattr(batches, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """End this pass: no more batches; its own workers stop."""
        self.end_epoch()
        loader, self._loader = self.__dict__.get("_loader"), None
        if loader is not None:
            loader.close()

    def __del__(self) -> None:
        self.close()


def _draws_only_from(index_sampler: Any, generator: torch.Generator | None) -> bool:
    """Whether ``index_sampler`` is one of torch's, drawing from ``generator`` (None:
    torch's global one) alone, so that :class:`_Sampling` can run it twice."""
    data = torch.utils.data
    sampler = index_sampler
    if type(index_sampler) is data.BatchSampler:
        sampler = index_sampler.sampler
    return (type(sampler) in (data.RandomSampler, data.SubsetRandomSampler,
                              data.WeightedRandomSampler)
            and sampler.generator is generator)


class _Sampling:
    """An epoch's sampled batches, known at once, while the random state moves as torch
    moves it. Torch pulls batches from its sampler as it goes (``prefetch_factor *
    num_workers`` at ``iter()``, then one per batch received), and a sampler may draw at
    any pull (``RandomSampler`` draws one more permutation as it ends): with two live
    iterators, or an iterator left early, those draws decide what the others sample. So
    :attr:`batches` come from a second iterator of the sampler, run at once from the same
    random state, which is then put back; the first is pulled as torch pulls its own.
    (Only for torch's random samplers on the loader's generator: other samplers are run
    once, at ``iter()``, which is torch's order whenever one iterator runs at a time.)"""

    def __init__(self, owner: DataLoader, indices: Iterator[Any], ahead: int) -> None:
        start = owner._rng()
        self.batches = list(iter(owner._torch._index_sampler))
        owner._set_rng(start)
        self._indices: Iterator[Any] | None = indices
        for _ in range(ahead):
            self.pull()

    def pull(self) -> None:
        """Pull one batch from the sampler (its values are those of :attr:`batches`)."""
        if self._indices is not None and next(self._indices, _NONE) is _NONE:
            self._indices = None


def _in_order(records: Iterator[Any], first: int, progress: _Progress,
              workers: int) -> Iterator[Any]:
    """The batches of ``(j, random state, batch)`` records in the order of ``j`` from
    ``first`` (a resumed epoch's first batch may not be worker 0's); each batch's
    random state goes into ``progress`` as it is yielded."""
    pending: dict[int, tuple[bytes | memoryview, Any]] = {}
    want = first
    for record in records:
        if not (isinstance(record, tuple) and len(record) == 3
                and isinstance(record[0], int) and record[0] >= want
                and isinstance(record[1], (bytes, memoryview))):
            raise RuntimeError(f"a DataLoader worker sent a batch out of place: {record!r:.80}")
        pending[record[0]] = (record[1], record[2])
        while want in pending:
            state, batch = pending.pop(want)
            if len(state):
                progress.workers[want % workers] = bytes(state)
            want += 1
            yield batch
    if pending:
        raise RuntimeError(f"the DataLoader's workers did not send batch {want}")


class _Prefetcher:
    """Runs ``batches`` on a thread that pins each batch and starts its copy to
    ``device``; at most ``depth`` batches wait. Errors are re-raised in the consumer.
    The thread holds no reference to this object, so dropping it stops the thread."""

    _END = object()

    def __init__(self, batches: Iterator[Any], pin: bool, device: torch.device | None,
                 depth: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_prefetch, args=(batches, pin, device, self._queue, self._stop),
            name="zloader-pin", daemon=True)
        self._thread.start()

    def __iter__(self) -> _Prefetcher:
        return self

    def __next__(self) -> Any:
        while True:
            try:
                batch, event = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise StopIteration from None  # stopped by close()
        if batch is self._END:
            raise StopIteration
        if isinstance(batch, BaseException):
            raise batch
        if event is not None:
            torch.cuda.current_stream().wait_event(event)  # the copy is done before use
        return batch

    def close(self, timeout: float = PREFETCH_STOP_SECONDS) -> None:
        """Stop the thread; wait for it (up to ``timeout`` seconds) to leave the batch it
        is reading, so that nothing else reads from this epoch's Loader afterwards."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __del__(self) -> None:
        self._stop.set()


def _prefetch(batches: Iterator[Any], pin: bool, device: torch.device | None,
              out: queue.Queue[Any], stop: threading.Event) -> None:
    """The body of a :class:`_Prefetcher`'s thread."""
    stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" \
        else None

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for batch in batches:
            if pin:
                batch = _apply(batch, lambda t: t.pin_memory())
            event = None
            if device is not None:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        batch = _apply(batch, lambda t: t.to(device, non_blocking=True))
                        event = torch.cuda.Event()
                        event.record(stream)
                else:
                    batch = _apply(batch, lambda t: t.to(device))
            if not put((batch, event)):
                return
        put((_Prefetcher._END, None))
    except BaseException as exc:  # re-raised in the consumer's thread
        put((exc, None))
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def _pack(batches: list[Any], batched: bool) -> dict[str, Any]:
    """An epoch's sampled batches as two int64 arrays (or lists when indices are not ints)."""
    groups = [list(b) if batched else [b] for b in batches]
    offsets = np.zeros(len(groups) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(g) for g in groups])
    flat_list = [i for g in groups for i in g]
    if all(isinstance(i, int) for i in flat_list):
        flat: Any = np.asarray(flat_list, dtype=np.int64)
    else:
        flat = flat_list
    return {"flat": flat, "offsets": offsets, "batched": batched}


def _apply(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {key: _apply(value, fn) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_apply(value, fn) for value in batch)
    return batch
