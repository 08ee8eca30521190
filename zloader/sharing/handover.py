"""What a shared job's worker hands on when it drains to move, so that trainers that start
its epochs later still get what it made (docs/sharing.md, "Moves").

A worker of a shared job keeps, per epoch, the splits it read, in order and per pass, to
make a late trainer's missed elements again (zloader/worker/shared.py). A worker the pool
moves to another job drains: it finishes its splits and sends what they made to every
trainer reading then, so those trainers get each element once. A trainer that starts one
of those epochs afterwards would never reach it, so the drained worker hands its splits
to the broker (``HEARTBEAT.handover``), which hands them to another worker of the job
(``HANDOVER``) as *segments*: one per epoch and worker, with the worker index its seeds
came from and the trainers it served. The worker that adopts a segment makes it again,
whole, for each trainer of that epoch not served yet, and hands its segments on in turn
when it drains.

A worker that dies (or moves at once) cannot hand anything on: the broker does it for
it, from the splits it handed that worker, in order, once every trainer has said how many
elements it got from that worker in the epoch (a fence, zloader/broker/failures.py). The
worker that adopts the segment makes it again for each trainer leaving out what it had
(its ``had``: the elements' places, which each record of a shared job names,
``DATA.first``): the same splits, in the same order, with the same seeds, make the same
elements in the same order, so a place names the same element. A trainer that joined the
epoch late on the dead worker had the middle of what it made, not its start. A mix the
workers draw by weight draws the same elements only with the same weights: a segment
carries when its worker's mix took new weights (``Loader.set_weights``), which the
broker notes before any element drawn with them leaves the worker (zloader/mixing.py
``Switches``), and its replay switches at the same draws.

This module holds no sockets: the segments and their wire form.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from zloader._defaults import HANDOVER_SERVED, HANDOVER_SPLITS, HANDOVER_SWITCHES

__all__ = ["Had", "Segment", "Switched", "from_wire", "rehanded", "to_wire"]

Key = tuple[int, ...]

Switched = dict[Key, list[tuple[int, tuple[float, ...]]]]
"""When a worker's mix took new weights, per pass key: ``(draws before, weights)``, in
order (the first at 0 when it started with weights set on a Loader)."""

Had = int | list[list[int]]
"""What a trainer had of what a worker made in an epoch: the first that many elements, or
the places of those it had (``[[start, end], ...]``, ascending: ``DATA.first``)."""


@dataclass(eq=False)
class Segment:
    """Splits one worker read in one epoch, to make again for trainers not ``served``.

    Attributes:
        epoch: the epoch.
        index: the worker index they were read under (its seeds: ``Context.rng``).
        splits: per pass key, the splits in the order they were read.
        served: the consumer ids that have everything the segment makes.
        had: the consumer ids that have some of the elements it makes (a dead worker's
            segment): how many of the first, or the places of those they have
            (:data:`Had`).
        fence: the dead worker's fence it was adopted under (a trainer it is made again
            for names it in its END; not on the wire).
        switches: per pass of a mix drawn by weight, when it took new weights
            (:data:`Switched`).
    """

    epoch: int
    index: int
    splits: dict[Key, list[int]]
    served: set[str] = field(default_factory=set)
    had: dict[str, Had] = field(default_factory=dict)
    fence: str | None = None
    switches: Switched = field(default_factory=dict)


def to_wire(segments: Iterable[Segment]) -> list[dict[str, Any]]:
    """``HEARTBEAT.handover``'s entries: one per segment and pass (a pass with more than
    HANDOVER_SPLITS splits in several), ``n`` numbering the segment they belong to; its
    switches of weights ride on them, HANDOVER_SWITCHES each (more: on entries of their
    own, of no split). The broker marks the last one it hands on (``last``): the taker
    adopts them all then."""
    out: list[dict[str, Any]] = []
    for n, segment in enumerate(segments):
        served = sorted(segment.served)[:HANDOVER_SERVED]
        switches = [[list(key), at, list(weights)] for key, switched
                    in segment.switches.items() for at, weights in switched]
        entries = [(key, splits[start:start + HANDOVER_SPLITS])
                   for key, splits in segment.splits.items()
                   for start in range(0, max(1, len(splits)), HANDOVER_SPLITS)]
        while entries and len(switches) > len(entries) * HANDOVER_SWITCHES:
            entries.append((entries[0][0], []))
        for at, (key, splits) in enumerate(entries):
            out.append({"n": n, "epoch": segment.epoch, "index": segment.index,
                        "pass": list(key), "splits": splits, "served": served,
                        "had": segment.had, "last": False,
                        "switches": switches[at * HANDOVER_SWITCHES:
                                             (at + 1) * HANDOVER_SWITCHES]})
    return out


def from_wire(entries: Iterable[dict[str, Any]]) -> list[Segment]:
    """The segments :func:`to_wire`'s entries (checked by the message) describe."""
    segments: dict[int, Segment] = {}
    for entry in entries:
        segment = segments.get(entry["n"])
        if segment is None or segment.epoch != entry["epoch"]:
            segment = segments[entry["n"]] = Segment(
                entry["epoch"], entry["index"], {}, set(entry["served"]), dict(entry["had"]))
        segment.splits.setdefault(tuple(entry["pass"]), []).extend(entry["splits"])
        for key, at, weights in entry["switches"]:
            segment.switches.setdefault(tuple(key), []).append((at, tuple(weights)))
    for segment in segments.values():  # (in order of their draws, each once)
        for key, switched in segment.switches.items():
            segment.switches[key] = sorted(dict(switched).items())
    return list(segments.values())


def rehanded(handovers: Iterable[Iterable[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The entries of ``HANDOVER`` messages, in the order they came, as one handover of
    their segments (a task that drained before it began hands on what it was handed:
    the segments of each handover, the broker's ``last`` ending one, numbered anew)."""
    segments: list[Segment] = []
    batch: list[dict[str, Any]] = []
    for entries in handovers:
        for entry in entries:
            batch.append(entry)
            if entry["last"]:
                segments += from_wire(batch)
                batch = []
    return to_wire(segments + from_wire(batch))
