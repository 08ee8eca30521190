"""What one run of a pipeline is given, and what it counts as it goes: the two halves of
a run's :class:`~zloader.stages.Context`. Sources see them as the ``policy`` of
``Source.read(split, policy)`` (``policy.settings``, ``policy.tally``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zloader._seeding import Key
from zloader.lineage import INDEX_BITS, Origin, encode_origins, gather

__all__ = ["RunSettings", "RunTally"]


@dataclass(frozen=True)
class RunSettings:
    """How a run goes, fixed when it starts.

    Attributes:
        entropy: random bits for stages with ``seed=None`` (drawn per run, or per job).
        worker: index of the worker running this part; workers other than 0 mix it into
            their random draws so they do not repeat worker 0's.
        workers: how many workers run this part (1 in-process).
        skip_errors: drop elements whose user code raises (``on_error="skip"``) instead of
            raising; each drop adds one to ``RunTally.skipped``.
        track: elements are ``(value, origin)`` pairs (:data:`~zloader.lineage.Tagged`; a
            worker part run for exactly-once epochs); stages apply user code to their
            values.
        round_size: the consumers of a coordinated job (``num_consumers``), which read
            ``round_size`` consecutive elements per round; ``bucket_by_length`` then emits
            its batches ``round_size`` at a time from one bucket. 1 otherwise.
        epoch_input: what the consumer sent with this epoch (adapters use it to hand
            workers the epoch's sampled batches); None for plain pipelines.
        mix_weights: a worker's :class:`~zloader.mixing.LiveWeights`: a mix's weights as
            its consumer last set them (None: the mix's own).
        dispatched: on a worker, what returns the next work item its consumer dispatched
            (``Loader.dispatch``; waits for one; None once none will follow), for a
            source whose ``dispatched`` is True; None in-process. Called with a count
            ``n``, a list of the next ``n`` items (fewer only when none follow them).
    """

    entropy: int
    worker: int = 0
    workers: int = 1
    skip_errors: bool = False
    track: bool = False
    round_size: int = 1
    epoch_input: Any = None
    mix_weights: Any = None
    dispatched: Callable[..., Any] | None = None


@dataclass
class RunTally:
    """What a run counts and collects as it goes, for the records it sends.

    Attributes:
        skipped: elements dropped because their user code raised (``skip_errors``).
        dropped: elements dropped to keep rounds whole (a bucket's last, incomplete round).
        loose: origins (codes) of elements dropped on the way, sent with the next record
            so the consumer counts them as accounted for.
        ends: ``[pass id, split, count, digest]`` of each split read, for the next record.
        pass_keys: the pass ids used in origins, by pass key (:meth:`pass_id`), and
        keys: the pass keys by pass id.
        reads: (pass id, split) of each split reading, by the read number in the origin
            codes (zloader/lineage/tags.py: ``code``).
        groups: the groups made since the last record, as the origin block holds them
            (zloader/groups.py).
        group_reads: each group's as the block holds it, by the read number that names
            its rows: a record holding rows of a group holds the group too, so that
            whichever consumer gets a row knows the group (a ``job_name``'s consumers
            share a worker's records).
    """

    skipped: int = 0
    dropped: int = 0
    loose: list[int] = field(default_factory=list)
    ends: list[list[int]] = field(default_factory=list)
    pass_keys: dict[Key, int] = field(default_factory=dict)
    keys: list[Key] = field(default_factory=list)
    reads: list[tuple[int, int]] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)
    group_reads: dict[int, list[int]] = field(default_factory=dict)

    def pass_id(self, key: Key) -> int:
        """The pass id of pass ``key`` in origins, given on first use (a group's rows
        have a pass of their own, so there are as many as groups in a run)."""
        number = self.pass_keys.get(key)
        if number is None:
            number = self.pass_keys[key] = len(self.keys)
            self.keys.append(key)
        return number

    def block(self, origins: Sequence[Origin]) -> bytes:
        """The origin block of a record whose elements hold ``origins``, with the loose
        codes, split ends and groups collected since the last block (then emptied), and
        the groups of the rows it holds."""
        groups = self.groups
        if self.group_reads:
            codes = gather(origins) if origins else np.empty(0, np.int64)
            if self.loose:
                codes = np.concatenate((codes, np.array(self.loose, np.int64)))
            reads = np.unique(codes >> INDEX_BITS).tolist()
            held = [self.group_reads[read] for read in reads if read in self.group_reads]
            if held:
                named = set(map(id, groups))
                groups = groups + [group for group in held if id(group) not in named]
        block = encode_origins(origins, self.loose, self.reads, self.pass_keys, self.ends,
                               groups, self.keys)
        self.loose, self.ends, self.groups = [], [], []
        return block
