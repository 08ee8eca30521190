"""``Loader``: iterate a pipeline run by zloader's workers, embedded or through a broker.

The Loader's I/O thread (zloader/client/) owns every socket: it registers the job with the
broker, follows the job's worker list, opens each epoch on every worker, returns credits,
and decodes records (from a shared-memory ring for co-located workers, from ZeroMQ frames
otherwise) into a queue. The iterating thread takes records from that queue in the order
zloader/client/merging.py decides, runs the pipeline's consumer part (docs/semantics.md)
and yields elements. This module is the public API: the arguments, the process lifecycle.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from zloader import _check, _native, handoff, packed
from zloader._defaults import (
    DEFAULT_TIMEOUT,
    HANDOFF_MIN_ELEMENTS,
    MIX_SPREAD_SPLITS,
    PACK_MIN_BYTES,
)
from zloader.client import STATE_VERSION, IOThread, Merger, Stats
from zloader.client.arguments import Arguments, checked
from zloader.client.draw import Inputs, MixOrder, Order, Regroup
from zloader.client.shipment import check_exposure, pack
from zloader.embedded import Embedded
from zloader.errors import MixWindowWarning, WorkerExited
from zloader.handoff import Handoff
from zloader.mixing import LiveWeights, new_weights, register_info
from zloader.pipeline import Pipeline
from zloader.plan import Plan, drawn_on_workers, plan
from zloader.runs import Context, RunSettings
from zloader.sharing.branches import prefix_of
from zloader.sharing.options import DEFAULT_BLOCK_SECONDS

__all__ = ["Loader"]

log = logging.getLogger("zloader.loader")


class Loader:
    """Iterate ``pipeline`` as run by zloader workers; one ``for`` loop is one epoch.

    Args:
        pipeline: the pipeline.
        broker: None for embedded mode (a broker in this process and ``num_workers`` local
            worker processes, reached through shared memory); or a broker address such as
            ``"tcp://10.0.0.5:5555"``, whose workers serve the job wherever they run.
        num_workers: local worker processes to start. Embedded: default one per core.
            With a broker: default 0 (use the broker's workers); N > 0 starts N more on this
            host, attached to that broker.
        sharding: ``"dynamic"`` (splits on demand), ``"static"`` (split j to worker
            j mod W) or ``"off"`` (every worker runs the whole pipeline).
        job_name: Loaders with the same name and pipeline split one job's elements.
        deterministic: reproducible order (static assignment, round-robin reading).
        transport: ``"auto"`` (shared memory for co-located workers) or ``"tcp"``.
        prefetch: records in flight per worker (default 8).
        timeout: seconds without an element (data from a worker) before raising
            :class:`zloader.Timeout`; a finite number. A worker that holds this Loader's
            credits and sends nothing for this long is stuck (user code blocked): the
            broker takes it off the job and the other workers read its splits; with no
            other worker, the Timeout names it (docs/reliability.md). Default 60.
        on_error: ``"raise"`` or ``"skip"`` (drop elements whose user code raises, or
            that the codec cannot encode).
        max_skipped: with ``"skip"``, raise once more than this many were dropped.
        ring_bytes: shared-memory ring capacity per co-located worker (default 64 MiB, or
            the worker's share of ``memory_budget`` when less; a ring grows when its
            records are large for it, within the budget). A ring takes the memory its
            records reach, not its capacity.
        balanced: with ``job_name``, the number N of Loaders sharing the job: workers then
            wait until all N have opened an epoch and deal its elements one at a time,
            round-robin, so each Loader gets an equal share (to within one element per
            worker) whatever its speed. 0 (the default) deals by credit. Costs throughput for
            small elements; the torch adapter uses it for ``torch.distributed`` ranks.
        start_method: how local workers start: ``"fork"`` (fast; they inherit this
            process's imports, like torch's DataLoader on Linux) or ``"spawn"`` (a fresh
            interpreter that inherits ``sys.path`` and the working directory, and imports
            the user's modules afresh, as torch's spawned workers do: embedded, the
            pipeline refers to them instead of carrying their code).
        share: attach to the job of any other sharing Loader on the same broker whose
            pipeline has the same fingerprint (and ``sharing``, ``deterministic``,
            ``on_error``): the pipeline runs once and every such Loader receives every
            element (docs/sharing.md). Needs ``broker``; excludes ``job_name``.
        share_window_bytes: with ``share``, the bytes of records each worker keeps for the
            trainers (default: a sixteenth of free memory, 64 MiB to 4 GiB).
        share_lag: with ``share``, what happens to a trainer that falls a window behind:
            ``"block"`` (the producer waits for it, up to ``share_block_seconds``, then
            skips it ahead) or ``"skip"`` (it jumps to the oldest element kept; counted in
            ``stats()["share_skipped"]``).
        share_block_seconds: see ``share_lag`` (default 10).
        num_consumers: coordinated reads (docs/coordinated.md): the N Loaders of one
            ``job_name`` (say, the ranks of a synchronous data-parallel run) read in rounds
            and yield the same rounds in the same order, one element each: the N elements
            of a round come from one worker, produced one after the other (with
            ``bucket_by_length``: from one bucket). Round 0 starts once all N have joined.
            Every consumer gets the same number of elements per epoch; an incomplete last
            round is dropped (``stats()["dropped"]``). Needs ``job_name`` and
            ``consumer_index``.
        consumer_index: this Loader's index in ``[0, num_consumers)``. A restarted
            consumer with the same index rejoins at the round the others are on.
        keys: a keys directory made by ``zloader keygen`` (the broker's), or None for
            ``$ZLOADER_KEYS``: every socket then authenticates with CURVE. Embedded mode
            needs none (its sockets are in a directory only this user can open).
        insecure: allow serving a large in-memory source on a non-loopback address (a
            remote broker) without keys; for trusted networks only.
        exactly_once: with dynamic sharding (and no ``share``, ``balanced``,
            ``num_consumers`` or ``deterministic``), every element carries its origin
            (split, index), so that when a worker dies its splits are read again less what
            was delivered, and :meth:`state_dict` can record the epoch (docs/reliability.md
            says what this asks of the source). False turns the bookkeeping off: a dead
            worker's splits are then read again whole (at least once).
        state: what :meth:`state_dict` returned (or a list of them, one per Loader of a
            ``job_name``): resume that epoch, yielding only the elements not yielded
            before. Needs ``exactly_once``.
        width: with ``sharding="static"``, the job's number of worker indices (split j
            goes to index j mod ``width``), whichever workers take them. Default:
            ``num_workers``; with a broker and ``num_workers=0``, the broker's idle workers
            when the job starts. The torch adapter sets it to run on the broker's workers.
        weight: with a broker, this job's share of the broker's worker pool relative to
            the other jobs' (default 1: equal shares; 2 asks for twice as many workers as a
            job of weight 1 when both wait for data). From 0.001 to 1000; the job's first
            Loader sets it (docs/pool.md).
        objects: elements may hold values of types the codec does not carry (a custom
            class, a bfloat16 tensor): the workers pickle those leaves and this Loader
            unpickles them from its own workers only (same user, same host, as torch's
            DataLoader does). Embedded mode only; the torch adapter sets it. Without it such
            a value raises CodecError naming it.
        pack_dataset: forked workers read the large lists of the pipeline's source and of
            its dataset's attributes (a million file paths; torchvision's ``samples``) from
            a packed copy in shared memory, so that reading them does not copy them into
            every worker (default True; docs/pipeline.md, "Packed datasets"). This
            Loader's own objects are left as they are. False: workers read the lists
            themselves, as torch's do.
        memory_budget: bytes that this Loader's shared-memory rings and the records in
            flight to it may take together (default: half of /dev/shm, at most a quarter
            of the host's memory). Rings start at each worker's share and grow for large
            records within it; each worker has at most its share in flight, so records
            too large for ``prefetch`` of them to fit come fewer at a time (logged once).
            See docs/pipeline.md, "Memory budget".

    Raises:
        ValueError / TypeError: a bad argument, named in the message.
        SerializationError: the pipeline cannot be pickled for its workers (a TypeError
            naming the stage and the value at fault).
    """

    def __init__(self, pipeline: Pipeline, *, broker: str | None = None,
                 num_workers: int | None = None, sharding: str = "dynamic",
                 job_name: str | None = None, deterministic: bool = False,
                 transport: str = "auto", prefetch: int | None = None,
                 timeout: float = DEFAULT_TIMEOUT, on_error: str = "raise",
                 max_skipped: int | None = None, ring_bytes: int | None = None,
                 balanced: int = 0, start_method: str = "fork", share: bool = False,
                 share_window_bytes: int | None = None, share_lag: str = "block",
                 share_block_seconds: float = DEFAULT_BLOCK_SECONDS,
                 num_consumers: int | None = None, consumer_index: int | None = None,
                 keys: Any = None, insecure: bool = False, exactly_once: bool = True,
                 state: Any = None, width: int | None = None, weight: float = 1.0,
                 objects: bool = False, pack_dataset: bool = True,
                 memory_budget: int | None = None) -> None:
        self._pid = os.getpid()  # the process that owns what this Loader starts
        args = checked(
            pipeline, broker=broker, num_workers=num_workers, sharding=sharding,
            job_name=job_name, deterministic=deterministic, transport=transport,
            prefetch=prefetch, timeout=timeout, on_error=on_error, max_skipped=max_skipped,
            ring_bytes=ring_bytes, balanced=balanced, start_method=start_method, share=share,
            share_window_bytes=share_window_bytes, share_lag=share_lag,
            share_block_seconds=share_block_seconds, num_consumers=num_consumers,
            consumer_index=consumer_index, keys=keys, insecure=insecure,
            exactly_once=exactly_once, state=state, width=width, weight=weight,
            objects=objects, pack_dataset=pack_dataset, memory_budget=memory_budget)
        self.pipeline, self._options = pipeline, args.options
        self._plan = plan(pipeline, args.options)  # (its mix drawn here, where it can be)
        _warn_mix_windows(pipeline, args)
        self._init_epochs(args)
        # Forked workers read the dataset's large lists packed, shared: packed after the
        # fork by a process of its own (zloader/handoff.py), or before it where that
        # cannot be done.
        swaps, later = _packing(pipeline, args)
        self._packed = [swap.view for swap in swaps]
        # What workers get of the pipeline: nothing when every one is forked from here.
        blob, self._served = pack(pipeline, inherited=args.embedded and args.inherit,
                                  local=args.embedded)
        check_exposure(self._served, args.broker, args.keys, args.insecure)
        self._embedded = Embedded()
        try:
            self._start_parts(args, blob, swaps, later)
        except BaseException:
            self.close()
            raise

    def _init_epochs(self, args: Arguments) -> None:
        """The state of this Loader's epochs: not closed, not joined to a job's epoch yet,
        the next epoch (a resumed state's), the mix's weights as set, and a deterministic
        job's order over its shards."""
        self._closed = self._joined = False
        self._job_name = args.job_name
        self._epoch = args.resume["epoch"] if args.resume is not None else 0
        self._weights: tuple[float, ...] | None = None  # set_weights
        self._weights_stamp = 0.0  # (when: time.time())
        self._live = LiveWeights()  # (the same, for a mix drawn here)
        # A deterministic job's order over its shards, resumed where a state left it.
        self._order = _order(self._plan, args.resume)

    def _start_parts(self, args: Arguments, blob: bytes, swaps: list[packed.Swap],
                     later: Handoff | None) -> None:
        """Start the broker and local workers (as ``args`` asks), the I/O thread
        registering the job (``blob``: what workers get of the pipeline) and its Merger,
        then hand on a resumed state's weights. The caller closes this Loader if it
        raises."""
        self.address = self._embedded.start(args.broker, args.workers, args.start_method,
                                            args.keys, self.pipeline, args.inherit, swaps,
                                            later)
        self._io = _io_thread(args, self.pipeline, self.address, blob, self._served,
                              self._embedded, self._plan)
        self._merger = _merger(args, self._io, self._processes)
        self._io.start()
        if args.resume is not None and args.resume["weights"] is not None:
            # (the first OPEN carries them, as set when the state's Loader set them)
            self._set_weights(args.resume["weights"], args.resume["weights_stamp"])

    @property
    def _processes(self) -> list[Any]:
        """The worker processes this Loader started (the torch drop-in's ``_workers``)."""
        return self._embedded.processes

    def prepared(self, timeout: float) -> bool | None:
        """Whether each of this Loader's forked workers has prepared its first epoch fine
        as it started (``Source.forked``: the torch drop-in's seeding and
        ``worker_init_fn``), waiting at most ``timeout`` seconds, until one failed to or
        ended; None when it is not known (spawned workers, a broker's)."""
        return self._embedded.prepared(timeout)

    # --- iteration ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        return self.iterate()

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run ``epoch`` (epochs only move forward).

        Raises:
            ValueError: ``epoch`` is before the next one.
        """
        epoch = _check.integer("epoch", epoch, 0)
        if epoch < self._epoch:
            raise ValueError(f"epoch {epoch} was already run (the next is {self._epoch}); "
                             "epochs only move forward")
        self._epoch = epoch

    def iterate(self, epoch_input: Any = None) -> Iterator[Any]:
        """Iterate the next epoch, as ``iter(loader)`` does, handing every worker's run of
        it ``epoch_input`` as ``RunSettings.epoch_input`` (zloader/runs.py): what the
        adapters decide per epoch, such as the torch adapter's sampled batches. One
        iterator at a time: a new one ends the previous one, which raises if used again.

        Args:
            epoch_input: None, or an element the codec carries (nested dicts, lists and
                tuples of arrays, scalars, strings and bytes), or a
                :class:`zloader.PerWorker` of them: worker ``i`` gets the ``i``-th alone.

        Returns:
            An iterator over the epoch's elements.

        Raises:
            RuntimeError: this Loader is closed.
            CodecError: the codec cannot carry ``epoch_input``.
        """
        self._check_process()
        if self._closed:
            raise RuntimeError("this Loader is closed")
        if (self._options.shared or self._options.coordinated) and not self._joined:
            self._join_job()
        epoch = self._epoch
        self._epoch += 1
        mix, order = self._plan.mix, self._order
        if isinstance(order, MixOrder):  # (each input's shards in turn, drawn here)
            drop = order.begin(epoch)
            parts = self._plan.parts
            inputs = self._merger.inputs(epoch, epoch_input, parts, False, [0] * parts)
            elements = _drawn(self._plan, inputs, epoch, False, self._live, self._merger,
                              order, drop)
        elif order is not None:  # (the workers make each shard's stream; ordered here)
            skip = order.begin(epoch)
            elements = _counted(order.elements(self._merger.inputs(
                epoch, epoch_input, order.shards, False, skip)), self._merger)
        elif mix is None:
            elements = self._merger.epoch(epoch, epoch_input)
        else:  # (the workers make each input's stream; the draws are made here)
            track = self._options.exactly_once
            inputs = self._merger.inputs(epoch, epoch_input, self._plan.parts, track)
            elements = _drawn(self._plan, inputs, epoch, track, self._live, self._merger)
        return _holding(self, self._plan.run_consumer(elements, epoch,
                                                      Context(RunSettings(entropy=0))))

    def _check_process(self) -> None:
        """Raise in a process other than the one that made this Loader (a fork's child):
        its threads, sockets and workers belong to that process; used here, it would wait
        for data that never comes.

        Raises:
            RuntimeError: this is not the Loader's process.
        """
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this Loader was made in process {self._pid} and cannot be used in process "
                f"{os.getpid()} (a forked child): its I/O thread, sockets and workers stay "
                "with the process that made it; make a new Loader in this process")

    def _join_job(self) -> None:
        """Wait for the broker's answer (bounded by ``timeout``) and take the job's current
        epoch when it is ahead. A sharing trainer reads that epoch whole (what it missed is
        made again for it at the end, see docs/sharing.md); a coordinated consumer reads it
        from the round the others are on."""
        job_epoch = self._merger.job_epoch()
        self._joined = True
        if job_epoch > self._epoch:
            if self._options.shared:
                log.info("joined a shared job at its epoch %d (under way or next): this "
                         "epoch replays what the workers still hold, then what they produce, "
                         "then the part that had left their window, made again for this "
                         "trainer alone", job_epoch)
            else:
                log.info("joined coordinated reads at the job's epoch %d", job_epoch)
            self._epoch = job_epoch

    def state_dict(self) -> dict[str, Any]:
        """Where this Loader is in its epoch, as a small JSON-serializable dict (its size
        grows with the splits under way, not with the epoch): ``Loader(pipeline, ...,
        state=...)`` then yields the rest of the epoch, each element not yet yielded once.
        Call it between elements, from the iterating thread. A finished epoch's state
        resumes at the next epoch, unless another Loader of the same ``job_name`` whose
        state is resumed with it was still in that epoch (its ``finished`` entry says what
        this one yielded of it). A deterministic Loader with the default sharding
        records instead where it is in its order over the job's shards, and resumes the
        exact rest of its stream, with any number of workers (docs/semantics.md).

        Raises:
            ValueError: this Loader does not keep origins (``exactly_once`` is off or does
                not apply) and is not deterministic with the default sharding, or its
                pipeline has a ``take``/``skip`` part run here.
        """
        self._check_process()
        if self._order is None and not self._options.exactly_once:
            raise ValueError("state_dict() needs exactly_once=True with sharding='dynamic' "
                             "(and no share, balanced or num_consumers; deterministic=True "
                             "with the default sharding has a state of its own): only then "
                             "does every element carry its origin")
        if self._plan.consumer_stages:
            raise ValueError("state_dict() cannot record a take/skip run by the consumer "
                             f"({', '.join(s.name for s in self._plan.consumer_stages)}); "
                             "drop it, or stop the loop yourself after N elements")
        state: dict[str, Any] = {"zloader": STATE_VERSION,
                                 "fingerprint": self.pipeline.fingerprint,
                                 "entropy": self._io.stats.entropy}
        if self._order is not None:  # (where it is in its order over the job's shards)
            state.update(delivered=[], **self._order.state(self._epoch))
        else:
            yielded = self._merger.yielded
            state["epoch"], state["delivered"] = yielded.state(self._epoch,
                                                               self._merger.elements)
            finished = yielded.finished_state()
            if finished is not None:
                state["finished"] = finished
        if self._weights is not None:
            state["weights"] = list(self._weights)
            state["weights_stamp"] = self._weights_stamp
        return state

    def set_weights(self, weights: Sequence[float]) -> None:
        """Change the weights of this Loader's mix (``Pipeline.mix``) from now on: in the
        epoch under way (each worker draws with them from its next element) and the next
        ones; :meth:`state_dict` records them and when they were set. On a shared job they
        change the run that every trainer of it reads; among the Loaders of a
        ``job_name``, the last call wins (workers keep the weights set last, and a resume
        from their states takes those).

        Raises:
            RuntimeError: this Loader is closed.
            ValueError: the pipeline is not a mix drawn by weight, or the weights are not
                one per input, finite, >= 0 and not all 0.
        """
        self._check_process()
        if self._closed:
            raise RuntimeError("this Loader is closed")
        self._set_weights(new_weights(self.pipeline.source, weights), time.time())

    def _set_weights(self, weights: tuple[float, ...], stamp: float) -> None:
        self._weights, self._weights_stamp = weights, stamp
        self._live.offer(weights, stamp)
        self._io.set_weights(weights, stamp)

    def dispatch(self, worker: int, items: Sequence[int] | np.ndarray, *,
                 until_done: bool = False) -> None:
        """Hand the worker of index ``worker`` work items (ints >= 0) of the epoch under
        way, for a source that makes its elements as they are dispatched
        (``Source.dispatched``: the torch drop-in's ``in_order=False`` hands each batch
        to whichever worker has room); it takes them in order
        (``Context.settings.dispatched``).
        No items: it gets no more this epoch. ``until_done``: this Loader keeps them until
        :meth:`dispatch_done` says they are done, and should the worker's stream of them
        be lost, the worker of that index gets those not done again (and drops those it
        held), before any dispatched after them: elements of items made twice so may come
        twice. Without it, items a lost stream held are lost.

        Raises:
            RuntimeError: this Loader is closed.
            TypeError: ``worker`` or an item is not an int.
            ValueError: ``worker`` or an item is negative.
        """
        self._check_process()
        if self._closed:
            raise RuntimeError("this Loader is closed")
        worker = _check.integer("worker", worker, 0)
        if isinstance(items, np.ndarray):  # (checked whole: the torch drop-in's batches)
            if items.ndim != 1 or items.dtype.kind not in "iu":
                raise TypeError(f"items must be ints, got an array of {items.dtype}")
            if items.size and items.min() < 0:
                raise ValueError(f"items must be >= 0, got {int(items.min())}")
            self._io.dispatch(worker, tuple(items.tolist()), until_done)
            return
        self._io.dispatch(worker, tuple(_check.integer("items", i, 0) for i in items),
                          until_done)

    def dispatch_done(self, worker: int, count: int) -> None:
        """The next ``count`` work items :meth:`dispatch` handed the worker of index
        ``worker`` with ``until_done`` in the epoch under way are done (their elements
        came): this Loader forgets them. Until then it keeps them, and should that
        worker's stream of them be lost (the broker gave up on this consumer while it was
        stopped, and it registered again; another worker took that index), the worker of
        that index gets them again, from the first not done, with its epoch's OPEN."""
        self._check_process()
        if not self._closed:
            self._io.dispatch_done(_check.integer("worker", worker, 0),
                                   _check.integer("count", count, 0))

    # --- status and lifecycle -------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Cumulative counters: ``elements`` yielded, ``bytes`` received, ``wait_seconds``
        (time the consumer waited for data), ``skipped``, ``per_worker`` (elements by worker
        pid), ``private`` (records that bypassed the ring because it was full),
        ``segments`` (records too large for the ring, sent in a segment of their own),
        ``held`` (records whose ring notice came before an earlier record of the same
        worker that went as a message, a segment or past a full ring: held back until it
        came, so that each worker's records keep their order), ``share_skipped`` (a shared
        job's elements this trainer lost by falling behind the window with
        ``share_lag="skip"``, or to a dead worker), ``share_replayed`` (elements made again
        for this trainer because they had left the window when it joined),
        ``rejected`` (corrupt records and malformed messages dropped, each logged), ``served``
        (how often workers fetched this Loader's ``pipeline``, when too large to pass
        through the broker, and its in-memory ``source``: once per host, see
        zloader/blobs.py),
        ``memory_budget`` (bytes for rings and records in flight) and ``prefetch`` (the
        records in flight per worker it allows now: ``Loader(prefetch=)`` unless records
        are too large for the budget),
        ``stage_seconds`` (where the time goes: the job's workers' seconds in ``pipeline``,
        ``splits``, ``encode`` and ``blocked``, as their broker last reported them, and
        this consumer's ``wait``; see zloader/_defaults/ STAGES). With
        ``num_consumers``: ``dropped`` (the job's elements of incomplete last rounds,
        dropped so that every consumer gets as many), ``rounds_lost`` (the job's rounds
        lost with a dead worker or consumer, skipped by every consumer alike) and
        ``rounds_missed`` (rounds this consumer passed over when it (re)joined an epoch
        under way; those lost for every consumer included)."""
        self._check_process()
        io, wait = self._io.stats, self._merger.wait
        stats = {"elements": self._merger.elements, "bytes": io.bytes, "wait_seconds": wait,
                 "skipped": io.skipped, "per_worker": dict(io.per_worker),
                 "private": io.private, "segments": io.segments, "held": io.held,
                 "records": io.records,
                 "share_skipped": io.lagged, "share_replayed": io.replayed,
                 "rejected": io.rejected, "served": dict(self._served.counts),
                 "memory_budget": self._io.loop.budget.total,
                 "prefetch": self._io.loop.budget.limit,
                 "stage_seconds": {**io.stages, "wait": round(wait, 3)}}
        if self._options.coordinated:
            stats.update(dropped=io.dropped, rounds_lost=io.rounds_lost,
                         rounds_missed=io.rounds_missed)
        return stats

    def close(self) -> None:
        """Stop everything this Loader started and release its memory (safe to call twice).
        In a forked child it only marks the child's copy closed: what it started belongs to
        the parent process."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return
        io = getattr(self, "_io", None)
        if io is not None:
            io.loop.leaving(self._left())
            io.close()
        embedded = getattr(self, "_embedded", None)
        if embedded is not None:
            embedded.close()
        self._packed = []

    def _left(self) -> dict[str, Any] | None:
        """What this Loader yielded of the epoch under way, as its state has it (``{epoch,
        delivered}``), when it closes in a ``job_name`` job with exactly-once: in the
        middle of an epoch, or having finished its part of one (the others may still be
        in it). Its BYE says so, and the broker reads none of it again for the job's
        other Loaders when a worker dies later (one that had ended the epoch before it
        died, and whose death the broker learns after this Loader left). None otherwise."""
        merger = getattr(self, "_merger", None)
        if (self._job_name is None or self._order is not None or merger is None
                or not self._options.exactly_once or self._plan.consumer_stages):
            return None
        try:
            if merger.yielded.iterating is None:
                return merger.yielded.finished_state()
            epoch, delivered = merger.yielded.state(self._epoch, merger.elements)
        except Exception:  # (closed from another thread mid-step: said without it)
            log.warning("could not say what this Loader yielded as it left: a worker "
                        "death may repeat some of it to the job's other Loaders",
                        exc_info=True)
            return None
        return {"epoch": epoch, "delivered": delivered} if delivered else None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()


def _packing(pipeline: Pipeline, args: Arguments) -> tuple[list[packed.Swap], Handoff | None]:
    """How forked workers get the pipeline's large lists packed: swaps made now (before
    the fork: short lists, or where packing after it cannot be done), or a handoff that
    packs them after it; neither without forked workers, with ``pack_dataset=False``, or
    for lists whose objects a worker would copy fewer than PACK_MIN_BYTES of."""
    if not (args.inherit and args.pack_dataset):
        return [], None
    writer = _native.pick("marshal_into", None)  # (packed.pack: None, the checks by type)
    if not handoff.available():
        return packed.prepare(pipeline, writer), None
    found = packed.found(pipeline.source)
    if sum(len(each.values) for each in found) >= HANDOFF_MIN_ELEMENTS:
        return [], Handoff(found, writer)
    if packed.copied_bytes(found) < PACK_MIN_BYTES:
        return [], None  # (small: each worker's copy costs less than packing would wait)
    return packed.prepare(pipeline, writer), None  # (quicker than forking a packer)


def _warn_mix_windows(pipeline: Pipeline, args: Arguments) -> None:
    """Say so when this Loader's mix is drawn on each of several workers (its weights then
    hold in every window only while each worker has splits of every input), and why."""
    why = drawn_on_workers(pipeline, args.options)
    if why is None or (args.broker is None and args.workers == 1):
        return
    first = pipeline.source.stop == "first_exhausted"  # type: ignore[attr-defined]
    warnings.warn(
        f"this mix is drawn on each worker, not where the workers' streams meet ({why}): "
        "each input is read in many splits so that every worker holds some of it, but its "
        "weights hold in every window only while each worker has splits of every input "
        f"(not near an input's end; a file input of fewer than {MIX_SPREAD_SPLITS} splits "
        "is read in that many parts, each reading it whole)"
        + ("; and stop='first_exhausted' ends each worker's mix when its first input ends "
           "there: an epoch holds about as many elements as iter()'s (0.96-1.0 of them "
           "measured), and no input is read whole" if first else "")
        + ". docs/semantics.md, 'Mixing', lists the mixes the consumer draws.",
        MixWindowWarning, stacklevel=3)


def _holding(loader: Loader, elements: Iterator[Any]) -> Iterator[Any]:
    """``elements``, keeping ``loader`` alive while they are iterated, as torch's iterator
    keeps its DataLoader: ``for x in Loader(...)`` holds no other reference to it."""
    try:
        yield from elements
    finally:
        del loader  # (held by this generator's frame until then)


def _order(planned: Plan, resume: dict[str, Any] | None) -> Order | MixOrder | None:
    """A deterministic job's order over its shards (one whose mix is drawn here: over
    each input's shards), resumed where ``resume``'s left it; None: the job is not read
    in shards.

    Raises:
        ValueError: ``resume`` is the state of the other kind of order (an older
            zloader's, which drew this mix on the workers, or the other way round).
    """
    if not planned.shards:
        return None
    order = resume.get("order") if resume is not None else None
    drawn = planned.mix is not None
    if order is not None and ("outputs" in order) != drawn:
        raise ValueError(
            "state is a deterministic Loader's whose mix was drawn "
            f"{'on the workers' if drawn else 'by the consumer'}, and this Loader's is "
            f"drawn {'by the consumer' if drawn else 'on the workers'} (a state of another "
            "zloader version): its order cannot be resumed; start the epoch again")
    resumed = {"epoch": resume["epoch"], **order} if resume is not None and order else None
    return MixOrder(planned.shards, resumed) if drawn else Order(planned.shards, resumed)


def _drawn(planned: Plan, inputs: Inputs, epoch: int, track: bool, live: LiveWeights,
           merger: Merger, order: MixOrder | None = None, drop: int = 0) -> Iterator[Any]:
    """The outputs of a mix this Loader draws, for ``epoch``: the draws over ``inputs``
    and the stages after the mix (zloader/plan.py), each output's elements noted as
    yielded (``track``: exactly-once) as it is yielded; a deterministic job's
    (``order``) over each input's shards in turn, the first ``drop`` outputs dropped
    (yielded before a resume)."""
    merger.job_epoch()  # (the job's entropy, for draws of seed None, is known by then)
    ctx = Context(RunSettings(entropy=merger.io.stats.entropy or 0, track=track,
                              mix_weights=live))
    if track:  # (the groups of an unbatch after the mix, made here)
        assert planned.mix is not None
        inputs.regroup = ctx.regroup = Regroup(inputs, planned.mix.after(), ctx.rebuilds)
        planned.remade_here(ctx)
    opened = inputs.opened if order is None else functools.partial(order.opened, inputs)
    outputs = planned.run_drawn(opened, epoch, ctx, inputs.rest)
    for output in outputs if order is None else order.outputs_of(outputs, drop):
        value = inputs.yielded(output, ctx) if track else output
        merger.elements += 1
        yield value
    inputs.finish(ctx)
    merger.yielded.done(epoch)


def _counted(elements: Iterator[Any], merger: Merger) -> Iterator[Any]:
    """``elements``, counted in the stats as they are yielded."""
    for element in elements:
        merger.elements += 1
        yield element


def _io_thread(args: Arguments, pipeline: Pipeline, address: str, blob: bytes,
               served: Any, embedded: Embedded, planned: Plan) -> IOThread:
    """The Loader's I/O thread (not started), registering its job with the broker at
    ``address``."""
    return IOThread(
        address, blob, fingerprint=pipeline.fingerprint, job_name=args.job_name,
        options=args.options, source=register_info(planned.pipeline.source),
        prefetch=args.prefetch,
        use_rings=args.transport == "auto", ring_bytes=args.ring_bytes, served=served,
        data_bind=embedded.endpoint("source"), consumer_index=args.consumer_index,
        keys=args.keys, resume=args.resume, timeout=args.timeout,
        own=embedded.own(),
        memory_budget=args.memory_budget, dispatched=pipeline.source.dispatched,
        parts=planned.parts, made_here=planned.mix.after() if planned.mix is not None else 0,
        prefix=prefix_of(planned) if args.options.shared else {})


def _merger(args: Arguments, io: IOThread, processes: list[Any]) -> Merger:
    """The Merger that orders what ``io`` receives; an embedded Loader's also says which of
    its own workers died and when the epoch cannot complete without them."""
    options = args.options
    lost = (functools.partial(_lost, processes, io.stats, options.sharding != "dynamic")
            if args.embedded else lambda: None)
    return Merger(io, timeout=args.timeout, deterministic=options.deterministic,
                  max_skipped=args.max_skipped,
                  deaths=functools.partial(_deaths, processes, io.stats), lost=lost,
                  resume=args.resume)


def _deaths(processes: list[Any], stats: Stats) -> str:
    """Which of a Loader's own worker processes died, how, and doing what. A function of
    those two, not a method: the Merger holds it, and a bound method would make the Loader
    and its Merger a cycle, which keeps a closed Loader's rings mapped until the garbage
    collector runs."""
    notes = []
    for process in processes:
        code = process.poll()
        if code is None:
            continue
        if not process.pid:  # (the forker failed to fork it: its error is on stderr)
            notes.append("one of this Loader's workers could not be forked")
            continue
        how = (f"was killed by {_signal_name(-code)}" if code < 0
               else f"exited with code {code}")
        last = stats.was_doing.get(process.pid)
        notes.append(f"this Loader's worker pid {process.pid} {how}"
                     + (f" in {last}" if last else ""))
    return "; ".join(notes)


def _lost(processes: list[Any], stats: Stats, pinned: bool) -> None:
    """Raise :class:`WorkerExited` when an embedded Loader's epoch cannot complete: one of
    its own workers died and the job's splits are pinned to worker indices (``pinned``:
    static sharding), or all of them died (no other worker serves an embedded job).

    Raises:
        WorkerExited: naming the dead workers, how they died and what they were doing.
    """
    ended = [p for p in processes if p.poll() is not None]
    dead = tuple(p.pid for p in ended)
    if not dead or (not pinned and len(dead) < len(processes)):
        return
    why = ("its splits are pinned to worker indices (static sharding), so no other "
           "worker can make them" if pinned and len(dead) < len(processes)
           else "no worker of this Loader is left")
    raise WorkerExited(f"{_deaths(processes, stats)}: the epoch cannot complete ({why})",
                       dead, tuple(p.poll() for p in ended))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


