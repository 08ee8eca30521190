"""What the consumer's loop hands the iterating thread, one record type per kind of item
(an exactly-once job's records carry their :class:`~zloader.lineage.Origins`, checked by
the loop), and what the iterating thread asks of the loop (:data:`Command`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from zloader._byfields import ByFields, FrozenByFields
from zloader.client.session import EpochInput
from zloader.lineage import Origins

__all__ = ["Command", "Data", "Done", "End", "Failed", "GiveCredit", "InputEnd", "Item", "Lost",
           "Origins", "SetWeights", "StartEpoch"]


@dataclass(eq=False, repr=False)
class Data(ByFields):
    """A record's elements from the worker at ``index`` (the job's worker index)."""

    epoch: int
    worker: str
    index: int
    elements: list[Any] = field(default_factory=list)
    origins: Origins | None = None  # exactly-once jobs: where its elements came from
    part: int | None = None  # the mix input it holds, when this consumer draws the mix


@dataclass(eq=False, repr=False)
class End(FrozenByFields):
    """One worker finished the epoch; ``origins``: those of the elements it dropped that
    no record carried (exactly-once)."""

    epoch: int
    worker: str
    index: int
    origins: Origins | None = None


@dataclass(eq=False, repr=False)
class InputEnd(FrozenByFields):
    """The worker at ``index`` has no more elements of mix input ``part`` this epoch
    (this consumer draws the mix); it sent every record of it before."""

    epoch: int
    worker: str
    index: int
    part: int


@dataclass(eq=False, repr=False)
class Lost(FrozenByFields):
    """A coordinated round this consumer held was lost for every consumer: its record's
    credit goes back, its elements are not yielded."""

    epoch: int
    worker: str
    index: int


@dataclass(eq=False, repr=False)
class Done(FrozenByFields):
    """Every worker finished the epoch and nothing of it is missing."""

    epoch: int


@dataclass(eq=False, repr=False)
class Failed(FrozenByFields):
    """The epoch cannot go on: raise ``error`` in the iterating thread."""

    error: BaseException
    epoch: int = -1


Item = Data | End | InputEnd | Lost | Done | Failed
"""What the loop hands the iterating thread."""


@dataclass(eq=False, repr=False)
class StartEpoch(FrozenByFields):
    """Open ``epoch`` on every worker, handing them ``frames`` (the epoch's input)."""

    epoch: int
    frames: EpochInput


class GiveCredit(NamedTuple):
    """The iterating thread used ``credits`` records of ``worker``: give them back. One
    per record: a named tuple, the cheapest to make."""

    worker: str
    credits: int = 1
    part: int | None = None  # the mix input whose records (this consumer draws the mix)


@dataclass(eq=False, repr=False)
class SetWeights(ByFields):
    """A mix's weights from now on (``Loader.set_weights``, at ``stamp``): tell every
    worker."""

    weights: tuple[float, ...]
    stamp: float


class DispatchItems(NamedTuple):
    """Work items for the worker of index ``worker`` in the epoch under way
    (``Loader.dispatch``); none: it gets no more. One per batch of the torch drop-in: a
    named tuple."""

    worker: int
    items: tuple[int, ...]
    keep: bool = False  # kept until done (Loader.dispatch_done), sent again if lost


class DispatchDone(NamedTuple):
    """The next ``items`` work items dispatched to the worker of index ``worker`` are
    done (``Loader.dispatch_done``)."""

    worker: int
    items: int


Command = StartEpoch | GiveCredit | SetWeights | DispatchItems | DispatchDone
"""What the iterating thread asks of the loop."""
