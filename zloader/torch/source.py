"""The source a DataLoader's workers run: the batches of an epoch the consumer sampled
(map-style datasets) or the dataset's own iterator (iterable ones), made as torch's
workers make them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.utils.data
from torch.utils.data._utils import collate as _torch_collate
from torch.utils.data._utils import worker as _torch_worker

from zloader import codec, handoff
from zloader._defaults import STACK_LATER_BYTES
from zloader.errors import PipelineError
from zloader.sources import Source
from zloader.torch import feed, seeding, states
from zloader.torch.failures import describe
from zloader.torch.tensors import NUMPY_DTYPES, to_numpy


@dataclass(frozen=True, eq=False, kw_only=True)
class BatchSource(Source):
    """Worker ``w`` of ``width`` makes the batches of a map-style epoch that the consumer
    dispatches to it as it samples them (zloader/torch/feed.py), or runs the iterable
    dataset as torch worker ``w``."""

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
    objects: bool = False  # to_numpy leaves to the codec's pickling what numpy cannot hold
    first_seed: int | None = None  # the first epoch's base seed: forked workers seed at once

    @property
    def num_splits(self) -> int:
        return self.width

    @property
    def dispatched(self) -> bool:
        return not self.iterable  # (a map-style epoch's batches, as they are sampled)

    def identity(self) -> tuple[Any, ...]:
        return (self.kind, self.token)  # this loader's job alone; the dataset is not hashed

    def forked(self, slot: int) -> bool | None:
        """Seed this worker, forked as worker ``slot``, for the first epoch now (torch's
        workers seed as they start, ``worker_init_fn`` included), not when its first
        batch is asked for: False when that raised."""
        if self.first_seed is not None and slot < self.width:
            return seeding.early(self.token, self.first_seed, slot, self.width,
                                 self.dataset, self.worker_init_fn)
        return None

    def read(self, split: int, policy: Any = None) -> Iterator[Any]:
        settings = policy.settings if policy is not None else None
        plan = settings.epoch_input if settings is not None else None
        if settings is None or not isinstance(plan, dict):
            raise RuntimeError("a torch DataLoader epoch reached a worker without its plan")
        worker = settings.worker
        if "shared_seed" in plan:  # an IterDataPipe: its shuffles, seeded as torch's
            shared = torch.Generator()
            shared.manual_seed(int(plan["shared_seed"]))
            torch.utils.data.graph_settings.apply_random_seed(self.dataset, shared)
        seeded = seeding.seeded(self.token, bool(plan["reseed"]), int(plan["seed"]), worker,
                                self.width, self.dataset, self.worker_init_fn, plan.get("rng"))
        if self.iterable:
            return self._iterable(plan, worker)
        return self._mapped(plan, worker, seeded, settings.dispatched)

    def _mapped(self, plan: dict[str, Any], worker: int, seeded: seeding.Seeded,
                dispatched: Callable[..., Any] | None) -> Iterator[dict[str, Any]]:
        """This worker's batches ``j`` of the epoch, as the consumer dispatches them (see
        ``zloader/torch/feed.py``: each with its indices, or, for a sampler of other keys,
        its number in this worker's plan, ``passes.worker_plans``), as records (dicts,
        ``"w"``: the worker): first ``{"start": snapshot, "rng": random state}``, then for
        each batch ``{"j": j, "rng": random state after it or b"" if unchanged, "batch":
        batch}`` (the consumer keeps the state of the last batch it yielded, for
        ``state_dict``), with ``"failure"`` in place of ``"batch"`` when the dataset or
        ``collate_fn`` raised, and ``"snap"`` (see ``states``) when the dataset keeps a
        state of its own. With ``plan["start"] == "first"`` the start goes with the first
        batch instead, as its ``"first"`` (alone if no batch comes). A resumed worker
        (``plan["resume"]``) first restores its dataset's state."""
        resume = plan.get("resume")
        if resume is not None:
            states.load(self.dataset, resume.get("dataset_state"))
        stateful = states.is_stateful(self.dataset)
        head = {"w": worker, "start": states.snapshot(worker, self.dataset, iterable=False),
                "rng": seeded.reported}
        start = head if plan.get("start") == "first" else None  # (goes with the first batch)
        if start is None:
            yield head
        if dispatched is None:
            raise RuntimeError("a map-style DataLoader epoch reached a worker that takes no "
                               "dispatched batches")
        where = f"in DataLoader worker process {worker}"
        batches = self._streamed(dispatched) if plan.get("streamed") \
            else self._planned(plan, dispatched)
        for j, keys in batches:
            handoff.poll()  # (the dataset's lists, packed since the last batch)
            record: dict[str, Any] = {"w": worker, "j": j}
            if start is not None:
                record["first"], start = start, None
            try:
                record["batch"] = to_numpy(self._fetch(keys, plan["batched"]), self.objects)
            except Exception as exc:
                at = f"indices {keys!r:.60}" if plan["batched"] else f"index {keys[0]!r}"
                record["failure"] = _failure(exc, at, where)
            state = seeding.capture_rng()
            changed, seeded.reported = state != seeded.reported, state
            record["rng"] = state if changed else b""
            if stateful:
                record["snap"] = states.snapshot(worker, self.dataset, iterable=False)
            yield record
        if start is not None:
            yield start

    @staticmethod
    def _streamed(take: Callable[..., Any]) -> Iterator[tuple[int, list[int]]]:
        """``(j, indices)`` of each batch dispatched with its indices
        (``feed.encode``), until the consumer sends no more.

        Raises:
            RuntimeError: a batch's items were cut short.
        """
        while (j := take()) is not None:
            size = take()
            coded = take(size) if size is not None else []
            if size is None or len(coded) != size:
                raise RuntimeError(f"the consumer dispatched batch {j} cut short")
            yield j, feed.decode(coded)

    @staticmethod
    def _planned(plan: dict[str, Any], take: Callable[..., Any]
                 ) -> Iterator[tuple[int, list[Any]]]:
        """``(j, keys)`` of each batch number dispatched, its keys from the plan.

        Raises:
            RuntimeError: a dispatched number is not in the plan.
        """
        flat, offsets, numbers = plan["flat"], plan["offsets"], plan["numbers"]
        while (j := take()) is not None:
            at = int(np.searchsorted(numbers, j))
            if at >= len(numbers) or numbers[at] != j:
                raise RuntimeError(f"the consumer dispatched batch {j}, which is not in "
                                   "this epoch's plan")
            indices = flat[offsets[at]:offsets[at + 1]]
            yield j, indices.tolist() if isinstance(indices, np.ndarray) else list(indices)

    def _fetch(self, keys: list[Any], batched: bool) -> Any:
        """A batch, made as torch's map-style fetcher makes it: ``__getitems__`` when the
        dataset has one, else ``dataset[i]`` for each index; then collated."""
        if not batched:
            return self._collate_one(self._get(keys[0]))
        if getattr(self.dataset, "__getitems__", None):
            try:
                samples = self.dataset.__getitems__(keys)
            except BaseException as exc:  # SystemExit too: the consumer must hear of it
                raise PipelineError.from_exception(
                    exc, "dataset", f"indices {keys!r:.60}") from exc
        else:
            samples = [self._get(i) for i in keys]
        return self._collate(samples)

    def _iterable(self, plan: dict[str, Any], worker: int) -> Iterator[dict[str, Any]]:
        """The dataset's iterator run as torch worker ``worker`` runs it, as records
        (dicts, ``"w"``: the worker): first ``{"start": snapshot, "rng": random state}``,
        then one per batch, ``{"batch": batch}`` or ``{"failure": ...}`` in place of a
        batch whose sample or collate raised (its other samples are lost, as in torch),
        with ``"snap"`` and ``"rng"`` after every ``plan["every"]``-th batch when the
        dataset or its iterator keeps a state, and last ``{"end": snapshot, "rng": ...}``
        (see ``states``); with ``plan["start"] == "first"`` the start goes with the first
        batch instead (or with the end), as its ``"first"``. A resumed worker
        (``plan["resume"]``: its snapshot and the batches it yielded since) restores the
        snapshot and makes those batches again without sending them; one whose iterator
        had ended sends its start and end."""
        resume = plan.get("resume")
        every = int(plan.get("every") or 0)
        iterator = states.resume_into(self.dataset, lambda: iter(self.dataset), resume)
        stateful = states.is_stateful(iterator) or states.is_stateful(self.dataset)

        def snap(ended: bool = False) -> dict[str, Any]:
            return states.snapshot(worker, self.dataset, iterator, ended)

        head = {"w": worker, "start": snap(states.ended(resume)), "rng": seeding.capture_rng()}
        start = head if plan.get("start") == "first" else None  # (goes with the first batch)
        if start is None:
            yield head
        if not states.ended(resume):
            skip = int((resume or {}).get("since", 0))
            made = 0
            for record in self._batches(iterator, worker):
                made += 1
                if made <= skip:
                    continue
                if stateful and every and made % every == 0:
                    record.update(snap=snap(), rng=seeding.capture_rng())
                if start is not None:
                    record["first"], start = start, None
                yield record
        end = {"w": worker, "end": snap(True), "rng": seeding.capture_rng()}
        if start is not None:
            end["first"] = start
        yield end

    def _batches(self, iterator: Iterator[Any], worker: int) -> Iterator[dict[str, Any]]:
        """The batches of ``iterator``, as torch worker ``worker`` makes them, each as a
        record ``{"w": worker, "batch": batch}`` or ``{"w": worker, "failure": ...}``."""
        where = f"in DataLoader worker process {worker}"
        ended = False
        number = -1  # this worker's batches so far
        while not ended:
            number += 1
            samples = []
            try:
                for _ in range(1 if self.batch_size is None else self.batch_size):
                    try:
                        samples.append(next(iterator))
                    except StopIteration:
                        ended = True
                        break
                if not samples or (self.batch_size is not None and self.drop_last
                                   and len(samples) < self.batch_size):
                    return
                made = to_numpy(self._collate_one(samples[0]) if self.batch_size is None
                                else self._collate(samples), self.objects)
            except Exception as exc:
                yield {"w": worker,
                       "failure": _failure(exc, f"its batch {number}", where)}
                continue
            yield {"w": worker, "batch": made}

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


def _failure(exc: Exception, at: str, where: str) -> tuple[str, ...]:
    """A batch's failure as a record carries it, ``at`` the batch's place in the input
    (``"indices [3, 7]"``) unless the error names one; what user code raised as other than
    an ``Exception`` (``SystemExit``, wrapped by :meth:`BatchSource._get`) ends the pass."""
    cause = exc.__cause__ if isinstance(exc, PipelineError) else exc
    if cause is not None and not isinstance(cause, Exception):
        raise exc
    stage = exc.stage if isinstance(exc, PipelineError) else "dataset"
    return describe(exc, stage, where, at)


def stack_later(batch: list[Any], *, collate_fn_map: Any = None) -> Any:
    """Torch's tensor collate, except that a large batch of equal, plain CPU tensors becomes
    a :class:`codec.Stacked` of their memory (the stack happens in the record's copy)."""
    elem = batch[0]
    if (type(elem) is torch.Tensor and elem.layout == torch.strided and not elem.is_nested
            and elem.device.type == "cpu" and elem.dtype in NUMPY_DTYPES
            and elem.numel() * elem.element_size() * len(batch) >= STACK_LATER_BYTES
            and all(type(t) is torch.Tensor and t.dtype == elem.dtype and t.shape == elem.shape
                    and t.device == elem.device for t in batch)):
        rows = [t.detach().resolve_conj().resolve_neg().contiguous().numpy() for t in batch]
        return codec.Stacked(rows)
    return _torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


_COLLATE_MAP = {**_torch_collate.default_collate_fn_map, torch.Tensor: stack_later}
