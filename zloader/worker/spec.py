"""What a worker's producer thread is given and speaks in: its task's
:class:`ProducerSpec` (fixed when the task starts), the :class:`LinkKind` of each message
it sends its worker's socket thread, and the broker's answers it is handed
(:class:`SplitAnswer`). The thread itself is zloader/worker/producer.py's."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from zloader._byfields import FrozenByFields
from zloader._defaults import PREFIX_HISTORY_BYTES
from zloader.lineage import Assigned
from zloader.options import JobOptions
from zloader.plan import Plan
from zloader.sharing.branches import Branch

__all__ = ["LinkKind", "Noted", "ProducerSpec", "SplitAnswer"]


class LinkKind(enum.Enum):
    """The kind of a message from a producer to its worker's socket thread (the frame on
    the pair; the body waits in :attr:`Producer.outbox`)."""

    SPLIT_REQ = b"S"  # {pass, have, ahead}: the next split(s) of this pass, please
    PASS_DONE = b"P"  # [pass key]: every split this producer took in the pass is read
    RECORD = b"R"     # an Outgoing: one record
    END = b"E"        # {epoch, skipped, dropped[, origins]}: the epoch is over here
    FAIL = b"F"       # {epoch, error}: user code failed
    WEIGHED = b"W"    # {pass, at, weights}: a shared job's mix takes new weights (Weighed)


class SplitAnswer(NamedTuple):
    """The broker's answer to a producer's ``SPLIT_REQ``, as the worker's main thread hands
    it over (:meth:`Producer.answer`; nothing is serialized between the two threads): the
    pass it is about, the split (None: no more of that pass for this worker), the
    request it answers (``have``; None: any) and, for an exactly-once job, the split as
    it is to be read (``assigned``: where it belongs, what to skip). One per split, made
    by the thousand for short splits: a named tuple, the cheapest to make."""

    pass_key: tuple[int, ...]
    split: int | None
    have: int | None = None
    assigned: Assigned | None = None


class Noted(NamedTuple):
    """The broker noted a producer's ``WEIGHED`` (its echo, handed over as
    :class:`SplitAnswer` is): pass ``pass_key`` draws with new weights from draw ``at``."""

    pass_key: tuple[int, ...]
    at: int


@dataclass(eq=False, repr=False)
class ProducerSpec(FrozenByFields):
    """What a producer needs of its task, fixed when the task starts.

    Attributes:
        plan: the pipeline, split into the worker's and the consumer's parts.
        first_tap: a shared job whose trainers may share a prefix of ``plan``'s pipeline
            (zloader/sharing/branches.py): the first stage boundary a branch may part
            from it at; 0: none (the job takes no branches).
        branches: such a job's other branches known when the epoch starts: their
            records come with ``Head.branch`` (more may be attached while it runs,
            :meth:`Producer.attach`).
        history_bytes: how many bytes of the trunk's elements a worker keeps from the
            epoch's start, so that a branch attached late still gets the whole epoch.
        options: the job's (zloader/options.py), ``exactly_once`` as the job runs it.
        index: this worker's index in the job (static sharding, seeds).
        width: the job's number of worker indices.
        entropy: the job's seed.
    """

    plan: Plan
    options: JobOptions
    index: int
    width: int
    entropy: int
    branches: tuple[Branch, ...] = ()  # a shared job's other branches, known now
    first_tap: int = 0  # a shared job that takes branches: its first tap (0: none)
    history_bytes: int = PREFIX_HISTORY_BYTES

    @property
    def sharding(self) -> str:
        """``"dynamic"`` (splits from the broker), ``"static"`` or ``"off"``."""
        return self.options.sharding

    @property
    def skip_errors(self) -> bool:
        """``on_error="skip"``: drop elements whose user code raises."""
        return self.options.on_error == "skip"

    @property
    def track(self) -> bool:
        """Exactly-once: elements carry their origins (zloader/lineage/intsets.py)."""
        return self.options.exactly_once

    @property
    def one_per_record(self) -> bool:
        """Deal one element per record (balanced and coordinated jobs, and a dispatched
        source's: its next element may wait for the consumer)."""
        return bool(self.options.balanced or self.options.num_consumers
                    or self.plan.pipeline.source.dispatched)

    @property
    def round_size(self) -> int:
        """The consumers of a round (coordinated jobs; 1 otherwise)."""
        return max(1, self.options.num_consumers)
