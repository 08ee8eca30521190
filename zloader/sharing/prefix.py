"""Which trainers share a prefix of their pipelines: the broker's side of prefix sharing
(zloader/sharing/branches.py is the worker's).

A shared job keeps the prefix fingerprints of its own pipeline's worker part
(``REGISTER.prefixes``: ``[i]`` is the source and its first ``i`` stages). A trainer whose
pipeline is another, with the same key options, joins the shared job with which it has
the most stages in common (at least one, and every ``repeat`` of both: ``first_tap``) as a
*branch* of it: its ``tap`` is how many it has in common with the job's own pipeline
(branch 0), which the workers run once for all. Plain values only: the broker never loads
a pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from zloader._byfields import ByFields, FrozenByFields
from zloader._defaults import MAX_BRANCHES

__all__ = ["Branches", "Member", "shared_stages"]


def shared_stages(ours: Sequence[str], theirs: Sequence[str], low: int, high: int) -> int:
    """How many stages two pipelines with these prefix fingerprints may share as a trunk:
    the most that are equal, at least ``low`` (and one) and at most ``high``; 0: they
    cannot share one."""
    shared = 0
    for i in range(min(len(ours), len(theirs), high + 1)):
        if ours[i] != theirs[i]:
            break
        shared = i
    return shared if shared >= max(1, low) else 0


@dataclass(eq=False, repr=False)
class Member(FrozenByFields):
    """A branch: its pipeline's fingerprint, prefix fingerprints and stage names, where
    workers get it (its REGISTER's payload ``blob``, or ``pipeline`` and ``source_data``
    as a TASK names them), the fewest stages it may share (``first_tap``) and the stages
    it shares with branch 0 (``tap``)."""

    fingerprint: str
    prefixes: tuple[str, ...]
    names: tuple[str, ...]
    blob: bytes = b""
    pipeline: dict[str, Any] | None = None
    source_data: dict[str, Any] | None = None
    first_tap: int = 1
    tap: int = 0


@dataclass(eq=False, repr=False)
class Branches(ByFields):
    """A shared job's branches: index 0 its own pipeline (``own``), index k
    ``members[k - 1]``."""

    own: Member
    members: list[Member] = field(default_factory=list)

    def index_of(self, fingerprint: str) -> int | None:
        """The branch of the pipeline with ``fingerprint``, if the job has it."""
        if fingerprint == self.own.fingerprint:
            return 0
        return next((k for k, m in enumerate(self.members, 1)
                     if m.fingerprint == fingerprint), None)

    def fit(self, prefixes: Sequence[str], first_tap: int) -> int:
        """The stages a pipeline with ``prefixes`` would share with branch 0 (0: it cannot
        join: too little in common, or the job has all the branches it takes)."""
        if len(self.members) + 1 >= MAX_BRANCHES:
            return 0
        own = self.own
        return shared_stages(own.prefixes, prefixes, max(first_tap, own.first_tap),
                             min(len(prefixes), len(own.prefixes)) - 1)

    def add(self, member: Member) -> int:
        """Add ``member`` (its ``tap`` from :meth:`fit`): its branch index."""
        self.members.append(member)
        return len(self.members)

    def view(self, index: int) -> dict[str, Any]:
        """For ``zloader status``: the stages branch ``index`` shares with branch 0 (the
        job's own pipeline), and its own after them."""
        member = self.own if index == 0 else self.members[index - 1]
        tap = member.tap if index else max((m.tap for m in self.members), default=0)
        return {"branch": index, "prefix": list(member.names[:tap]),
                "suffix": list(member.names[tap:])}
