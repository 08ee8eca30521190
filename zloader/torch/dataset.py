"""The torch ``IterableDataset`` over a Pipeline (and its ranks under torch.distributed)."""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Generator, Iterator
from typing import Any

import torch
import torch.utils.data

from zloader import _check
from zloader.loader import Loader
from zloader.pipeline import Pipeline
from zloader.torch.tensors import to_torch


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
        run = os.environ.get("TORCHELASTIC_RUN_ID") or os.urandom(8).hex()
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
