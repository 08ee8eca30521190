"""The consumer's side of exactly-once epochs (docs/reliability.md): what a
:meth:`Loader.state_dict` holds (the origins of the elements yielded so far,
:class:`Yielded`), and how a saved state resumes (:func:`resume_from`). When a job is
exactly-once is one rule for both sides, :func:`zloader.lineage.exactly_once`. The origins
received, the fences and the rereads are the I/O thread's (zloader/client/epoch_end.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeGuard, cast

from zloader import _native
from zloader._defaults import MAX_BODY_BYTES, MAX_FANOUT, MAX_REGISTER_BODY_BYTES
from zloader._hash import sha256
from zloader.lineage import Ledger, Origins, Ranges, merge_indices

__all__ = ["STATE_VERSION", "Yielded", "resume_from"]

# A consumer's ledgers add a shuffle's codes with the compiled core where it is built.
Ranges.merge = staticmethod(_native.pick("merge_indices", merge_indices))

STATE_VERSION = 1
"""The version of what Loader.state_dict returns."""


class Yielded:
    """The origins of the elements of the epoch being yielded, kept by the iterating
    thread: those of every record yielded whole, and the record under way. A resumed
    Loader's start with what its state had delivered of the resumed epoch, so that a state
    taken from it covers the epoch since it began, across any chain of resumes.

    Args:
        resume: ``{epoch, delivered}`` of the state this Loader resumed (as
            :func:`resume_from` merged it), or None.
    """

    def __init__(self, resume: dict[str, Any] | None = None) -> None:
        self._resume = resume
        self.ledger = Ledger()
        self.iterating: int | None = None  # the epoch being yielded, until it is done
        self.finished: int | None = None  # the epoch last yielded whole (``ledger`` is its)
        # The record being yielded, and the element count when its first was yielded.
        self._current: tuple[Origins, int] | None = None
        # A mix drawn here: adds what was yielded of records not yielded whole.
        self.partial: Callable[[Ledger], None] | None = None

    def begin(self, epoch: int) -> None:
        """``epoch`` starts: nothing of it yielded yet, but what a resumed state had."""
        self.ledger, self._current, self.iterating = self._start(epoch), None, epoch
        self.finished, self.partial = None, None

    def _start(self, epoch: int) -> Ledger:
        """What was yielded of ``epoch`` before it began here: the resumed state's part."""
        resume = self._resume
        if resume is None or resume["epoch"] != epoch:
            return Ledger()
        if resume.get("ledger") is not None:  # (merged already: a copy of it)
            return cast(Ledger, resume["ledger"]).copy()
        ledger = Ledger()
        ledger.merge_json(resume["delivered"])
        return ledger

    def record(self, origins: Origins | None, elements: int) -> None:
        """A record starts being yielded, ``elements`` having been yielded before it."""
        if origins is not None:
            self._current = (origins, elements)

    def recorded(self, origins: Origins | None, epoch: int) -> None:
        """A record (or an END's loose origins) of ``epoch`` was yielded whole."""
        if origins is not None and self.iterating == epoch:
            origins.note(self.ledger)
            self._current = None

    def done(self, epoch: int) -> None:
        """Every element of ``epoch`` was yielded: what was yielded of records not yielded
        whole (a mix drawn here that stopped at its first input's end leaves some partly
        drawn) joins the ledger, which a finished state holds."""
        if self.iterating == epoch:
            if self.partial is not None:
                self.partial(self.ledger)
                self.partial = None
            self.iterating, self.finished = None, epoch

    def finished_state(self) -> dict[str, Any] | None:
        """``{epoch, delivered}`` of the epoch last yielded whole: another Loader of the
        same ``job_name`` may still be in it, and a resume then needs what this one
        yielded of it."""
        if self.iterating is not None or self.finished is None:
            return None
        return {"epoch": self.finished, "delivered": self.ledger.to_json()}

    def state(self, next_epoch: int, elements: int) -> tuple[int, Any]:
        """The epoch to resume and the JSON of what was delivered of it, ``elements``
        having been yielded so far (a finished epoch resumes at ``next_epoch``; an epoch
        not begun yet is as its resumed state left it, if it is the resumed one)."""
        if self.iterating is None:
            return next_epoch, self._start(next_epoch).to_json()
        epoch = self.iterating
        ledger = self.ledger.copy()
        if self._current is not None:
            origins, before = self._current
            origins.note(ledger, elements - before)
        if self.partial is not None:
            self.partial(ledger)
        return epoch, ledger.to_json()


def resume_from(state: Any, fingerprint: str, exactly_once: bool,
                ordered: bool = False) -> dict[str, Any] | None:
    """Check ``state`` (one :meth:`Loader.state_dict` or a list of them) and merge it into
    ``{epoch, entropy, delivered, digest, weights, weights_stamp, ledger}`` (``ledger``:
    ``delivered`` merged, a :class:`Ledger` the Loader copies), with ``order``
    (``{shards, turn, yielded}``, or ``{shards, outputs}`` where the consumer draws a
    mix) for a deterministic Loader read in shards (``ordered``, whose state is one
    Loader's); None for None.

    Raises:
        ValueError: it is not such a state, or of another pipeline (another
            ``fingerprint``), or ``exactly_once`` does not apply, or it is the state of a
            Loader read in shards and this one is not (or the other way round).
    """
    if state is None:
        return None
    orders = [one.get("order") for one in (state if isinstance(state, list) else [state])
              if isinstance(one, dict)]
    if ordered or any(order is not None for order in orders):
        return _ordered(state, fingerprint, ordered)
    if not exactly_once:
        raise ValueError("state= needs exactly_once=True with sharding='dynamic' (and no "
                         "share, balanced, num_consumers or deterministic)")
    states = _checked_states(state, fingerprint)
    epoch = _resumed_epoch(states)
    ledger = Ledger()
    for one in states:
        if one["epoch"] == epoch:
            ledger.merge_json(one.get("delivered"))
        elif _finished(one) == epoch:
            ledger.merge_json(one["finished"]["delivered"])
    entropy = next((one["entropy"] for one in states if isinstance(one.get("entropy"), int)),
                   None)
    delivered = ledger.to_json()
    text = json.dumps([epoch, entropy, delivered]).encode()
    _check_sendable(text)
    digest = sha256(text).hexdigest()
    # A mix's weights set on the Loaders: those set last (a state without a stamp, of an
    # older version, counts as set before any with one; then the last such state's)
    weighted = [(_stamp(one), at, one["weights"]) for at, one in enumerate(states)
                if one.get("weights")]
    stamp, _, weights = max(weighted) if weighted else (0.0, 0, None)
    return {"epoch": epoch, "entropy": entropy, "delivered": delivered, "digest": digest[:12],
            "weights": weights, "weights_stamp": stamp, "ledger": ledger}


def _check_sendable(text: bytes) -> None:
    """Refuse a merged state whose JSON (``text``) no REGISTER could carry.

    Raises:
        ValueError: it is larger than MAX_REGISTER_BODY_BYTES less a REGISTER's other
            fields.
    """
    room = MAX_REGISTER_BODY_BYTES - MAX_BODY_BYTES  # (a REGISTER's other fields: the rest)
    if len(text) > room:
        raise ValueError(
            f"state= holds {len(text) / 2**20:.1f} MiB of delivered origins: more than a "
            f"Loader can send its broker to resume ({room / 2**20:.0f} MiB, "
            "MAX_REGISTER_BODY_BYTES less a REGISTER's other fields). It grows with the "
            "splits under way and the groups anchored in them (a stage that changes the "
            "number of rows, after a shuffle): take states with a smaller shuffle buffer "
            "before that stage or fewer workers, or pass exactly_once=False")


def _checked_states(state: Any, fingerprint: str) -> list[dict[str, Any]]:
    """``state`` (one :meth:`Loader.state_dict` or a list of them) as a list of states,
    each checked.

    Raises:
        ValueError: the list is empty, or one is not such a state, or of another pipeline.
    """
    states = state if isinstance(state, list) else [state]
    if not states:
        raise ValueError("state= got an empty list")
    for one in states:
        if not (isinstance(one, dict) and one.get("zloader") == STATE_VERSION
                and isinstance(one.get("epoch"), int) and one["epoch"] >= 0):
            raise ValueError("state must be what Loader.state_dict() returned (a dict with "
                             f"'zloader': {STATE_VERSION}, 'epoch', 'delivered')")
        if one.get("fingerprint") != fingerprint:
            raise ValueError("state was saved by a Loader of another pipeline (its "
                             "fingerprint differs); resume with the same pipeline")
    return states


def _ordered(state: Any, fingerprint: str, ordered: bool) -> dict[str, Any]:
    """A deterministic Loader's state (``Loader.state_dict`` with an ``order``), checked.

    Raises:
        ValueError: it is not one, or this Loader is not read in shards, or the state is
            of another pipeline.
    """
    one = state[0] if isinstance(state, list) and len(state) == 1 else state
    order = one.get("order") if isinstance(one, dict) else None
    if not ordered:
        raise ValueError("state is a deterministic Loader's (it has an 'order'): resume it "
                         "with deterministic=True and the default sharding")
    if order is None:
        raise ValueError("state= with deterministic=True needs the state of a deterministic "
                         "Loader (Loader(deterministic=True).state_dict(), with an 'order')")
    shards, turn, yielded = (order.get(k) if isinstance(order, dict) else -1
                             for k in ("shards", "turn", "yielded"))
    drawn = isinstance(order, dict) and "outputs" in order  # (a mix drawn by the consumer)
    if drawn:  # (where it is: the outputs yielded)
        where = set(order) == {"shards", "outputs"} and _natural(order["outputs"])
    else:  # (the shard whose turn it is, and the elements yielded of each)
        where = (isinstance(order, dict) and set(order) == {"shards", "turn", "yielded"}
                 and _natural(shards) and _natural(turn) and turn < shards
                 and isinstance(yielded, list) and len(yielded) == shards
                 and all(_natural(n) for n in yielded))
    if not (one.get("zloader") == STATE_VERSION and _natural(one.get("epoch"))
            and _natural(shards) and 1 <= shards <= MAX_FANOUT and where):
        raise ValueError("state must be what Loader(deterministic=True).state_dict() "
                         f"returned: {{'zloader': {STATE_VERSION}, 'epoch', 'order': "
                         "{'shards' >= 1, 'turn' < shards, 'yielded': one count per shard} "
                         "or, for a mix the consumer draws, {'shards' >= 1, 'outputs' >= 0}}")
    if one.get("fingerprint") != fingerprint:
        raise ValueError("state was saved by a Loader of another pipeline (its "
                         "fingerprint differs); resume with the same pipeline")
    entropy = one.get("entropy") if _natural(one.get("entropy")) else None
    digest = sha256(json.dumps([one["epoch"], entropy, order]).encode()).hexdigest()
    return {"epoch": one["epoch"], "entropy": entropy, "delivered": [],
            "digest": digest[:12], "weights": one.get("weights") or None,
            "weights_stamp": _stamp(one),
            "order": {"shards": shards, "outputs": order["outputs"]} if drawn
            else {"shards": shards, "turn": turn, "yielded": list(order["yielded"])}}


def _natural(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _stamp(state: dict[str, Any]) -> float:
    """When a state's weights were set (0: not said)."""
    stamp = state.get("weights_stamp")
    return float(stamp) if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) \
        and 0 <= stamp < 1e12 else 0.0


def _finished(state: dict[str, Any]) -> int | None:
    """The epoch ``state``'s Loader had yielded whole and not gone past, if it says so."""
    finished = state.get("finished")
    if isinstance(finished, dict) and isinstance(finished.get("epoch"), int) \
            and state["epoch"] == finished["epoch"] + 1 and not state.get("delivered"):
        return int(finished["epoch"])
    return None


def _resumed_epoch(states: list[dict[str, Any]]) -> int:
    """The epoch a job resumes: the one some of its Loaders were still in when the others
    had yielded their part of it whole (the job's epoch is not over until every Loader's
    is), else the latest (an epoch every Loader finished is over)."""
    behind = min(one["epoch"] for one in states)
    if all(one["epoch"] == behind or _finished(one) == behind for one in states):
        return behind
    return max(one["epoch"] for one in states)
