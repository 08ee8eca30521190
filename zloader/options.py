"""One job's options: :class:`JobOptions`, built once from a Loader's arguments and carried
whole from there on.

The path of the options: ``Loader(...)`` checks its arguments (each error names the
argument) and builds one :class:`JobOptions`, whose :meth:`JobOptions.check` holds the
rules between options (the broker applies it to every REGISTER too, so a hand-made client
is refused in the same words); the consumer sends it as ``REGISTER.options``;
the broker keeps it on the job (``zloader/broker/records.py: Job.options``) with
``exactly_once`` as the job runs it (:meth:`JobOptions.applied`); it sends it to each
worker as ``TASK.options``; the worker's task hands it to its delivery mode and its
producers. What is per consumer rather than per job (its id, pid, host, ``consumer_index``,
a resumed run's ``resume`` and ``entropy``) travels beside it, never in it.

On the wire it is one JSON object with every field present (docs/protocol.md);
:meth:`JobOptions.from_body` checks each, and a bad one is refused naming it
(``REGISTER: field 'options.weight' must be a number from 0.001 to 1000, got 0``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zloader._byfields import FrozenByFields
from zloader._defaults import MAX_FANOUT, WEIGHT_RANGE
from zloader.lineage import exactly_once
from zloader.sharing.window import LAG_POLICIES
from zloader.transport.fields import Wrong, boolean, integer, is_int, number, text

__all__ = ["ON_ERROR", "SHARDING_MODES", "JobOptions", "share_settings"]

SHARDING_MODES = ("dynamic", "static", "off")
ON_ERROR = ("raise", "skip")


def share_settings(value: Any) -> dict[str, Any]:
    """A shared job's window: ``{window_bytes >= 1, lag, block_seconds >= 0}``."""
    size: Any = value.get("window_bytes") if isinstance(value, dict) else None
    block: Any = value.get("block_seconds") if isinstance(value, dict) else None
    if not (is_int(size) and size >= 1 and value.get("lag") in LAG_POLICIES
            and isinstance(block, (int, float)) and not isinstance(block, bool)
            and block >= 0):
        raise Wrong(f"must be {{window_bytes >= 1, lag: {' or '.join(LAG_POLICIES)}, "
                    "block_seconds >= 0}")
    return {"window_bytes": size, "lag": value["lag"], "block_seconds": float(block)}


def _maybe_share(value: Any) -> dict[str, Any] | None:
    return None if value is None else share_settings(value)


@dataclass(eq=False, repr=False, kw_only=True)
class JobOptions(FrozenByFields):
    """How a job runs, the same for all its consumers and workers.

    Attributes:
        sharding: ``"dynamic"`` (splits from the broker), ``"static"`` or ``"off"``.
        deterministic: consumers read the workers in a fixed order (and dynamic
            sharding runs as static: :meth:`applied`).
        on_error: ``"raise"`` or ``"skip"`` elements whose user code raises.
        num_workers: the job's worker indices (0: as many as the pool gives).
        balanced: deal one element at a time to this many consumers (0: off).
        num_consumers: coordinated reads by this many consumers (0: off).
        share: a shared job's window settings, or None (not shared).
        exactly_once: elements carry their origins (zloader/lineage/intsets.py). The Loader's
            request; the broker keeps what the job runs (:meth:`applied`).
        weight: the job's share of the worker pool relative to other jobs'.
        objects: elements may hold leaves of types the codec does not know: workers
            pickle them (zloader/codec.py), and the consumer unpickles them only from
            its own forked workers (``Loader(objects=True)``).
        shards: a deterministic job read in this many fixed shards, whatever its number
            of workers (each worker runs the shards of its index modulo their number, and
            the consumer takes one element of each shard in turn), so that its stream is
            the same with any number of workers and a state can resume it exactly
            (zloader/plan.py); 0: one per worker index (the workers' order).
    """

    sharding: str = field(default="dynamic", metadata={"check": text(choices=SHARDING_MODES)})
    deterministic: bool = field(default=False, metadata={"check": boolean})
    on_error: str = field(default="raise", metadata={"check": text(choices=ON_ERROR)})
    num_workers: int = field(default=0, metadata={"check": integer(0)})
    balanced: int = field(default=0, metadata={"check": integer(0, MAX_FANOUT)})
    num_consumers: int = field(default=0, metadata={"check": integer(0, MAX_FANOUT)})
    share: dict[str, Any] | None = field(default=None, metadata={"check": _maybe_share})
    exactly_once: bool = field(default=False, metadata={"check": boolean})
    weight: float = field(default=1.0, metadata={"check": number(*WEIGHT_RANGE)})
    objects: bool = field(default=False, metadata={"check": boolean})
    shards: int = field(default=0, metadata={"check": integer(0, MAX_FANOUT)})

    @property
    def shared(self) -> bool:
        """Loaders with the same pipeline attach to one job (``share=True``)."""
        return self.share is not None

    @property
    def coordinated(self) -> bool:
        """Consumers read round by round (``num_consumers``)."""
        return self.num_consumers > 0

    def check(self, job_name: str | None) -> None:
        """The rules between the options (and the job's ``job_name``), which the Loader
        and the broker both apply (a REGISTER breaking one is refused with the same words).

        Raises:
            ValueError: two options do not mix, or coordinated reads lack a job_name.
        """
        if self.shared and job_name is not None:
            raise ValueError("share=True and job_name do not mix: job_name splits a job's "
                             "elements between Loaders, share gives every Loader all of them")
        if self.shared and self.balanced:
            raise ValueError("share=True and balanced do not mix")
        if not self.coordinated:
            return
        if self.shared:
            raise ValueError("share=True and num_consumers do not mix: share gives every "
                             "trainer every element, coordinated reads split them in rounds")
        if self.balanced:
            raise ValueError("balanced and num_consumers do not mix: coordinated reads "
                             "already give every consumer as many elements")
        if self.deterministic:
            raise ValueError("deterministic=True and num_consumers do not mix: rounds go to "
                             "the workers in the order their elements are ready")
        if not job_name:
            raise ValueError("coordinated reads (num_consumers) need a job_name shared by the "
                             f"{self.num_consumers} consumers, so that they find one job")

    def applied(self) -> JobOptions:
        """These options as the job runs them: a deterministic job's dynamic sharding is
        static (its splits go to fixed worker indices, read round-robin), and
        ``exactly_once`` holds only when asked for and the job is dynamic, not shared,
        balanced, coordinated or deterministic (the one rule,
        :func:`zloader.lineage.exactly_once`). The Loader and the broker both run a job
        by these."""
        sharding = ("static" if self.deterministic and self.sharding == "dynamic"
                    else self.sharding)
        runs = exactly_once(self.exactly_once, self.sharding, self.shared,
                            self.deterministic, self.coordinated, self.balanced)
        if (sharding, runs) == (self.sharding, self.exactly_once):
            return self
        return dataclasses.replace(self, sharding=sharding, exactly_once=runs)

    @classmethod
    def from_body(cls, body: Any) -> JobOptions:
        """The options a JSON object holds, every field present and checked.

        Raises:
            Wrong: it is not an object, or a field is missing or bad (``Wrong.field``
                names it).
        """
        if not isinstance(body, Mapping):
            raise Wrong("must be a JSON object of the job's options")
        values = {}
        for option in dataclasses.fields(cls):  # ``option.metadata["check"]``
            if option.name not in body:
                raise Wrong("is missing", field=option.name)
            try:
                values[option.name] = option.metadata["check"](body[option.name])
            except Wrong as exc:
                raise Wrong(str(exc), field=option.name, value=body[option.name]) from None
        return cls(**values)

    def to_body(self) -> dict[str, Any]:
        """The JSON object of these options."""
        return {option.name: getattr(self, option.name) for option in dataclasses.fields(self)}
