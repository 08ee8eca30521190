"""The Loader's arguments, checked in one place: :func:`checked` turns what
``Loader(...)`` was given into an :class:`Arguments` record, with the job's
:class:`JobOptions` built and checked by the rules between them (``JobOptions.check``).
Each error names the argument at fault and what to pass instead (zloader/_check.py has
the checks of one value)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from zloader import _check
from zloader._byfields import FrozenByFields
from zloader._defaults import DEFAULT_PREFETCH, MIN_MEMORY_BUDGET, START_METHODS, WEIGHT_RANGE
from zloader.client.exactly_once import resume_from
from zloader.groups import pipeline_refusal
from zloader.options import ON_ERROR, SHARDING_MODES, JobOptions
from zloader.pipeline import Pipeline
from zloader.sharing.options import settings
from zloader.transport.keys import resolve as resolve_keys
from zloader.transport.ring import ALIGN

__all__ = ["TRANSPORTS", "Arguments", "checked", "choice", "coordination", "share_settings",
           "timeout_seconds", "valid_ring_bytes"]

log = logging.getLogger("zloader.loader")

TRANSPORTS = ("auto", "tcp")


def timeout_seconds(timeout: Any) -> float:
    """Check ``timeout``: a finite positive number of seconds."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) \
            or not math.isfinite(timeout) or timeout <= 0:
        # nan compares false with everything and inf never elapses: either would
        # silently turn the bound off
        raise ValueError(f"timeout must be a finite positive number of seconds, got "
                         f"{timeout!r}")
    return float(timeout)


def valid_ring_bytes(value: Any) -> int | None:
    """Check ``ring_bytes`` here, not seconds later in the I/O thread."""
    value = _check.optional_integer("ring_bytes", value, ALIGN)
    if value is not None and value % ALIGN:
        raise ValueError(f"ring_bytes must be a multiple of {ALIGN} bytes, got {value}")
    return value


def share_settings(pipeline: Pipeline, broker: str | None, share: bool,
                   window_bytes: int | None, lag: str,
                   block_seconds: float) -> dict[str, Any] | None:
    """Check the sharing arguments: the shared job's window settings, or None without
    ``share``. (What share may not go with is the job's options' rule:
    ``JobOptions.check``.)"""
    if not _check.boolean("share", share):
        return None
    if broker is None:
        raise ValueError("share=True needs a broker that every sharing trainer uses: start "
                         "zloader-broker and pass broker='tcp://HOST:PORT'")
    if not pipeline.shareable:
        log.warning("this pipeline cannot be fingerprinted soundly (see the "
                    "FingerprintWarning), so share=True runs it alone")
    return settings(window_bytes, lag, block_seconds)


def coordination(num_consumers: Any, consumer_index: Any) -> tuple[int, int] | None:
    """Check the coordinated-read arguments: (num_consumers, consumer_index) or None.
    (What they may not go with is the job's options' rule: ``JobOptions.check``.)"""
    if num_consumers is None and consumer_index is None:
        return None
    if num_consumers is None or consumer_index is None:
        given = "num_consumers" if consumer_index is None else "consumer_index"
        raise ValueError(f"{given} was given alone: coordinated reads need both "
                         "num_consumers (how many consumers read the job) and consumer_index "
                         "(this one's, from 0)")
    size = _check.integer("num_consumers", num_consumers, 1)
    index = _check.integer("consumer_index", consumer_index, 0)
    if index >= size:
        raise ValueError(f"consumer_index must be in [0, num_consumers) = [0, {size}), got "
                         f"{index}")
    return size, index


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """Check that argument ``name`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


@dataclass(eq=False, repr=False)
class Arguments(FrozenByFields):
    """What a Loader was given, checked: the values its parts are built from.

    Attributes:
        broker: the broker's address, or None (embedded).
        job_name: the job's name; a resumed run's names a fresh job (``name@digest``).
        workers: the local worker processes to start.
        start_method: ``"fork"`` or ``"spawn"``.
        pack_dataset: forked workers read the dataset's large lists packed.
        options: the job's options as the job runs them (:meth:`JobOptions.applied`).
        transport: ``"auto"`` or ``"tcp"``.
        prefetch: records in flight per worker.
        timeout: seconds without data before :class:`zloader.Timeout`.
        max_skipped: with ``on_error="skip"``, the most elements dropped, or None.
        ring_bytes: a ring's capacity, or None (the default).
        memory_budget: bytes for rings and records in flight, or None (the default).
        consumer_index: this consumer's index in coordinated reads, or None.
        keys: the CURVE keys (with a broker), or None.
        insecure: serve large in-memory sources without keys.
        resume: the resumed state (``resume_from``), or None.
    """

    broker: str | None
    job_name: str | None
    workers: int
    start_method: str
    pack_dataset: bool
    options: JobOptions
    transport: str
    prefetch: int
    timeout: float
    max_skipped: int | None
    ring_bytes: int | None
    memory_budget: int | None
    consumer_index: int | None
    keys: Any
    insecure: bool
    resume: dict[str, Any] | None

    @property
    def embedded(self) -> bool:
        """A broker in this process and only this Loader's workers (``broker=None``)."""
        return self.broker is None

    @property
    def inherit(self) -> bool:
        """Local workers are forked: they inherit the pipeline as it is here."""
        return self.start_method == "fork" and self.workers > 0


def checked(pipeline: Any, *, broker: Any, num_workers: Any, sharding: Any, job_name: Any,
            deterministic: Any, transport: Any, prefetch: Any, timeout: Any, on_error: Any,
            max_skipped: Any, ring_bytes: Any, balanced: Any, start_method: Any, share: Any,
            share_window_bytes: Any, share_lag: Any, share_block_seconds: Any,
            num_consumers: Any, consumer_index: Any, keys: Any, insecure: Any,
            exactly_once: Any, state: Any, width: Any, weight: Any, objects: Any,
            pack_dataset: Any, memory_budget: Any) -> Arguments:
    """``Loader(...)``'s arguments checked, one by one and then the job's options by the
    rules between them (the Loader's docstring says what each means).

    Raises:
        ValueError / TypeError: a bad argument, named in the message.
    """
    _check_choices(pipeline, sharding=sharding, weight=weight, transport=transport,
                   on_error=on_error, broker=broker, job_name=job_name)
    workers = _worker_count(num_workers, broker)
    choice("start_method", start_method, START_METHODS)
    memory_budget = _check.optional_integer("memory_budget", memory_budget, MIN_MEMORY_BUDGET)
    pack_dataset = _check.boolean("pack_dataset", pack_dataset)
    timeout = timeout_seconds(timeout)
    window = share_settings(pipeline, broker, share, share_window_bytes, share_lag,
                            share_block_seconds)
    coordinated = coordination(num_consumers, consumer_index)
    width = _check.optional_integer("width", width, 1)
    options = _job_options(job_name, broker, coordinated, window, sharding=sharding,
                           deterministic=deterministic, on_error=on_error, workers=workers,
                           width=width, balanced=balanced, exactly_once=exactly_once,
                           weight=weight, objects=objects)
    refused = pipeline_refusal(pipeline) if options.exactly_once else None
    if refused:
        raise ValueError(refused)
    # keys: embedded mode needs none, but a bad keys= is still an error
    resolved = resolve_keys(keys) if broker is not None or keys is not None else None
    options, resume, job_name = _resumed(pipeline, options, sharding, state, job_name)
    return Arguments(
        broker=broker, job_name=job_name, workers=workers, start_method=start_method,
        pack_dataset=pack_dataset, options=options, transport=transport,
        prefetch=_check.integer("prefetch", DEFAULT_PREFETCH if prefetch is None
                                else prefetch, 1),
        timeout=timeout, max_skipped=_check.optional_integer("max_skipped", max_skipped, 0),
        ring_bytes=valid_ring_bytes(ring_bytes), memory_budget=memory_budget,
        consumer_index=coordinated[1] if coordinated else None,
        keys=resolved if broker is not None else None, insecure=insecure, resume=resume)


def _check_choices(pipeline: Any, *, sharding: Any, weight: Any, transport: Any,
                   on_error: Any, broker: Any, job_name: Any) -> None:
    """Check the pipeline, the arguments that pick one of a few values (``sharding``,
    ``transport``, ``on_error``), ``weight``, and the broker's address and job's name when
    given."""
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"pipeline must be a zloader.Pipeline, got {type(pipeline).__name__}")
    choice("sharding", sharding, SHARDING_MODES)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
            or not WEIGHT_RANGE[0] <= weight <= WEIGHT_RANGE[1]:
        raise ValueError(f"weight must be a number from {WEIGHT_RANGE[0]} to "
                         f"{WEIGHT_RANGE[1]:.0f} (a job's share of "
                         f"the broker's workers relative to other jobs'), got {weight!r}")
    choice("transport", transport, TRANSPORTS)
    choice("on_error", on_error, ON_ERROR)
    if broker is not None:
        _check.address("broker", broker)
    if job_name is not None:
        _check.label("job_name", job_name)


def _worker_count(num_workers: Any, broker: Any) -> int:
    """Check ``num_workers``: the local workers to start (default: one per core embedded,
    none with a broker); embedded mode needs at least one."""
    workers = _check.optional_integer("num_workers", num_workers, 0)
    if workers is None:
        workers = (os.cpu_count() or 1) if broker is None else 0
    if broker is None and workers == 0:
        raise ValueError("num_workers must be >= 1 in embedded mode (broker=None); "
                         "for an in-process run iterate the pipeline itself")
    return workers


def _job_options(job_name: Any, broker: Any, coordinated: tuple[int, int] | None,
                 window: dict[str, Any] | None, *, sharding: Any, deterministic: Any,
                 on_error: Any, workers: int, width: int | None, balanced: Any,
                 exactly_once: Any, weight: Any, objects: Any) -> JobOptions:
    """The job's options from the arguments checked so far (``objects``, ``deterministic``,
    ``balanced`` and ``exactly_once`` checked here), checked by the rules between them
    (``JobOptions.check``) and as the job runs them (``JobOptions.applied``)."""
    if _check.boolean("objects", objects) and broker is not None:
        raise ValueError("objects=True needs embedded mode (broker=None): pickled "
                         "elements are accepted only from this Loader's own workers, and "
                         "a broker's other workers could serve the job")
    options = JobOptions(
        sharding=sharding, deterministic=_check.boolean("deterministic", deterministic),
        on_error=on_error, num_workers=workers if width is None else width,
        balanced=_check.integer("balanced", balanced, 0),
        num_consumers=coordinated[0] if coordinated else 0, share=window,
        exactly_once=_check.boolean("exactly_once", exactly_once), weight=float(weight),
        objects=objects)
    options.check(job_name)
    return options.applied()


def _resumed(pipeline: Pipeline, options: JobOptions, sharding: Any, state: Any,
             job_name: Any) -> tuple[JobOptions, dict[str, Any] | None, Any]:
    """Check ``state`` (``resume_from``): the job's options (a job read in shards gets
    their number: its first run's), the resumed state or None, and the job's name (a
    resumed run's names a fresh job)."""
    # deterministic=True with the default sharding: read in fixed shards (as many as its
    # first run's workers), so that a state resumes its stream with any number of them
    ordered = options.deterministic and sharding == "dynamic" and options.num_workers > 0
    resume = resume_from(state, pipeline.fingerprint, options.exactly_once, ordered)
    if ordered:
        options = dataclasses.replace(options, shards=resume["order"]["shards"]
                                      if resume is not None else options.num_workers)
    if resume is not None and job_name is not None:
        job_name = f"{job_name}@{resume['digest']}"  # a fresh job for the resumed run
    return options, resume, job_name
