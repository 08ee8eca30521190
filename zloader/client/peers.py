"""A consumer's connections to the job's workers: one DEALER each, the shared-memory
ring of a co-located one (grown when its records are large for it), the one-record
segments it maps, and the credits it grants (OPEN, CREDIT)."""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from zloader._byfields import ByFields
from zloader._defaults import (
    DEFAULT_RING_BYTES,
    LEAVE_GRACE_SECONDS,
    MAX_ITEMS,
    RING_BUDGET_SLACK,
    RING_MAX_BYTES,
)
from zloader._host import host_id
from zloader._native import fence
from zloader.client.budget import Budget
from zloader.client.rounds import Rounds
from zloader.client.session import Session, Settings
from zloader.client.stats import Stats
from zloader.transport.notice import Notices
from zloader.transport.protocol import Command, ProtocolError, doing, doing_text, encode
from zloader.transport.ring import ALIGN as RING_ALIGN
from zloader.transport.ring import COUNT_MASK as RING_COUNT_MASK
from zloader.transport.ring import credits_word, open_of
from zloader.transport.shm import sweep
from zloader.transport.sockets import NOBLOCK, make_socket, send_frames

__all__ = ["Peer", "Peers", "local_address"]

log = logging.getLogger("zloader.loader")


@dataclass(eq=False, repr=False)
class Peer(ByFields):
    """One worker serving this consumer's job, and this consumer's side of its stream."""

    worker: str
    task: str | None
    index: int
    pid: int
    endpoint: str
    socket: zmq.Socket[Any]
    ring: Any = None
    returned: int = 0  # credits the iterating thread gave back, not yet sent
    # ... per mix input, when this consumer draws the mix (Settings.parts)
    part_returned: dict[int, int] = field(default_factory=dict)
    # (epoch, its DATA messages received), and the framed records whose notices came
    # before DATA messages that precede them (transport/notice.py): Receiver.notice
    messages: tuple[int, int] = (-1, 0)
    deferred: deque[tuple[float, Any, list[Any], int]] = field(default_factory=deque)
    mapped: list[str] = field(default_factory=list)  # one-record segments to let go of
    old_rings: list[Any] = field(default_factory=list)  # rings being replaced by a larger one
    host: str = ""
    heard: float = 0.0  # when it last sent something, or was last given credits it lacked
    owed: int = 0  # credits granted for this epoch and not yet used by a record
    # ... of each part (mix input) this consumer draws, and the parts whose END came
    part_owed: dict[int, int] = field(default_factory=dict)
    ended_parts: set[int] = field(default_factory=set)
    reported: float = float("-inf")  # when it was last reported stuck
    doing: dict[str, Any] | None = None  # {epoch, split, stage}, from the job's view
    own: bool = False  # this Loader forked it: its records may hold pickled leaves
    opened: int | None = None  # the epoch it was last opened for
    # Credits given back through its ring's header (transport/ring.py): the number of its
    # latest OPEN there (None: CREDIT messages only), the credits given back since, and
    # the worker's last wait for them answered with a CREDIT (its ``starving`` word)
    counter: int | None = None
    counted: int = 0
    woken: int = 0
    seen: int = 0  # ... and its last wait seen, with the credits given back before it
    since: int = 0

    def used(self, part: int | None) -> None:
        """A record of this epoch came (of ``part``): its credit is used."""
        self.owed -= 1
        if part is not None and part in self.part_owed:
            self.part_owed[part] -= 1

    def spendable(self) -> int:
        """The credits it holds and can still use: of a mix drawn here, those of the
        inputs it has not ended (the others' it never will: a worker that waits for
        credits of an input it still makes is not stuck because it holds them)."""
        if not self.part_owed:
            return self.owed
        return sum(n for part, n in self.part_owed.items() if part not in self.ended_parts)

    def describe(self) -> str:
        """``worker pid P on HOST (stage S of split N, epoch E)``, as far as known."""
        text = f"worker pid {self.pid} on {self.host or self.endpoint}"
        if self.doing is not None:
            text += f" ({doing_text(self.doing)})"
        return text


class Peers:
    """The workers the job's view lists, by worker id. ``on_gone`` is called after each
    worker that left the view is closed (the epoch may be over without it)."""

    def __init__(self, settings: Settings, session: Session, stats: Stats,
                 rounds: Rounds | None) -> None:
        self.settings = settings
        self.session = session
        self.stats = stats
        self.rounds = rounds
        self.on_gone: Callable[[], None] = lambda: None
        self.lost: str | None = None  # the last worker taken off the job, described
        self._peers: dict[str, Peer] = {}
        # Workers the view no longer lists that may still have records of the epoch on the
        # way (see :meth:`update`), read until their END or a deadline: each stream's
        # peer, by the stream (a worker moved away, back and away again within the
        # grace has two).
        self._leaving: dict[int, tuple[Peer, float]] = {}
        # Those of them that left the job cleanly (JOB.drained): they sent their END last,
        # and the epoch waits for it (records of theirs may still be on the way)
        self._awaited: set[int] = set()
        self._opened: set[tuple[str, int]] = set()  # (task, epoch) this consumer opened
        self._by_socket: dict[Any, Peer] = {}  # every open peer's, leaving ones' too
        self._index_of: dict[str, int] = {}  # every worker that ever served the job
        self.budget = Budget(settings.memory_budget, settings.prefetch, settings.width)
        self.large = self.budget.large(1)  # records above this size may not fit the budget
        self._ring_bytes = settings.ring_bytes  # a new worker's ring (see update)
        self._context: zmq.Context[Any] | None = None
        self._poller: zmq.Poller | None = None
        # The pipe co-located workers announce ring records on (transport/notice.py), and
        # every ring by its id in their notices (the old ones of a grown ring too).
        self.notices: Notices | None = None
        self._rings: dict[int, tuple[Peer, Any]] = {}
        self._ring_ids = 0  # the last id given
        self._opens = 0  # the last OPEN number given (OPEN.counter)

    def attach(self, context: zmq.Context[Any], poller: zmq.Poller) -> None:
        """Make sockets in ``context`` and poll them with ``poller`` (the I/O thread's);
        with rings, make the notice pipe and poll it too."""
        self._context, self._poller = context, poller
        if self.settings.use_rings:
            try:
                self.notices = Notices()
            except OSError as exc:
                log.warning("cannot make a notice pipe in /dev/shm (%s): ring records "
                            "come with a message each", exc)
            else:
                poller.register(self.notices.fd, zmq.POLLIN)

    def ring_by_id(self, ring_id: int) -> tuple[Peer, Any] | None:
        """The peer and ring a notice names by ``ring_id``; None for a ring this consumer
        no longer reads (its worker left: notices it wrote before may still wait).

        Raises:
            ProtocolError: no ring ever had that id.
        """
        found = self._rings.get(ring_id)
        if found is None and not 0 < ring_id <= self._ring_ids:
            raise ProtocolError(f"a notice names ring id {ring_id}, which this consumer "
                                "never opened")
        return found

    def _give_ring(self, peer: Peer, size: int | None) -> Any:
        """A new ring for ``peer`` (None when /dev/shm has no room), with an id."""
        ring = make_ring(size)
        if ring is not None:
            self._ring_ids += 1
            ring.ring_id = self._ring_ids
            self._rings[self._ring_ids] = (peer, ring)
        return ring

    def _forget_ring(self, ring: Any) -> None:
        """``ring`` is closed: notices naming it are passed over."""
        self._rings.pop(getattr(ring, "ring_id", 0), None)

    # --- who they are ---------------------------------------------------------------------

    def __iter__(self) -> Iterator[Peer]:
        """The peers, as a copy: closing one while iterating is safe."""
        return iter(list(self._peers.values()))

    def __len__(self) -> int:
        return len(self._peers)

    def workers(self) -> set[str]:
        """The ids of the workers connected now."""
        return set(self._peers)

    def get(self, worker: str) -> Peer | None:
        """The peer of ``worker``, if connected."""
        return self._peers.get(worker)

    def of(self, sock: Any) -> Peer | None:
        """The peer whose socket is ``sock`` (a leaving one's too: see :meth:`update`)."""
        return self._by_socket.get(sock)

    def index_of(self, worker: str) -> int | None:
        """The worker index ``worker`` had when it served the job (None: it never did)."""
        return self._index_of.get(worker)

    # --- the job's view -------------------------------------------------------------------

    def update(self, workers: Iterable[dict[str, Any]], drained: Collection[str] = ()) -> None:
        """Follow the job's worker list (its JOB view): connect to the new ones, close
        the ones it no longer lists, and read a worker given a new task afresh.
        ``drained``: the job's tasks that left it cleanly (JOB.drained); one of them
        that has not ended the epoch here holds the epoch's end until it does (or
        ``LEAVE_GRACE_SECONDS``: :meth:`awaited`)."""
        seen = set()
        workers = list(workers)
        self._ring_bytes = self.settings.ring_bytes or self.budget.ring_bytes(len(workers))
        self.large = self.budget.large(len(workers))
        for entry in workers:  # checked by the JOB record
            worker = entry["worker"]
            peer = self._peers.get(worker)
            if peer is not None:
                peer.doing = doing(entry.get("doing"))
            if peer is not None and entry.get("task") != peer.task:
                # The broker dropped this worker and gave it a task again: the old stream
                # is over (what it held was re-queued); read the new task afresh.
                self.close(peer, polite=False)
                peer = None
            seen.add(worker)
            if peer is None:
                self._connect(entry)
        gone = [w for w in self._peers if w not in seen]
        session = self.session
        for worker in gone:
            peer = self._peers[worker]
            if worker not in session.ended:
                self.lost = peer.describe() + " stopped answering"
            if worker not in session.ended and not self.settings.exactly_once \
                    and session.epoch is not None and not session.done:
                # A worker moved to another job sent what it made before it moved (its
                # END last), on a socket the broker's view can overtake: read on until
                # that END (or LEAVE_GRACE_SECONDS). An exactly-once job must close at
                # once: its consumers answer a fence with what they hold.
                del self._peers[worker]
                self._leaving[id(peer)] = (peer, time.monotonic() + LEAVE_GRACE_SECONDS)
                if peer.task in drained:
                    self._awaited.add(id(peer))
            else:
                self.close(peer, polite=False)
            self.on_gone()
        if gone:
            sweep()  # a worker that died cannot unlink its segments: remove them for it

    def _connect(self, entry: dict[str, Any]) -> None:
        assert self._context is not None and self._poller is not None
        keys = self.settings.keys
        # PLAIN for a worker started with --plain-data
        sock = make_socket(self._context, zmq.DEALER, keys,
                           plain=keys is not None and entry.get("plain_data") is True)
        try:
            sock.connect(str(entry["endpoint"]))
        except zmq.ZMQError as exc:
            sock.close(0)
            log.warning("cannot connect to worker %s at %r: %s", entry["worker"],
                        entry["endpoint"], exc)
            return
        task = entry.get("task") if isinstance(entry.get("task"), str) else None
        peer = Peer(entry["worker"], task, int(entry.get("index", 0)),
                    int(entry.get("pid", 0)), str(entry["endpoint"]), sock,
                    host=str(entry.get("host", ""))[:255], heard=time.monotonic(),
                    doing=doing(entry.get("doing")))
        local = entry.get("host_id") == host_id()
        peer.own = local and peer.pid in self.settings.own
        if self.settings.use_rings and local:
            peer.ring = self._give_ring(peer, self._ring_bytes)
        self._peers[peer.worker] = peer
        self._by_socket[sock] = peer
        if not self.settings.fixed:
            # A worker back under a new task (moved away and back, mid-epoch) reads new
            # splits and ends the epoch again: its END of the old task must not count.
            self.session.ended.discard(peer.worker)
        self._index_of[peer.worker] = peer.index
        self.stats.indices = tuple(p.index for p in self._peers.values())
        self._poller.register(sock, zmq.POLLIN)
        if self.session.epoch is not None and not self.session.done:
            self.open(peer)

    def left(self, peer: Peer) -> None:
        """``peer`` sent its END: if it was leaving, close its socket (the same worker
        back under a new task has another peer)."""
        self._awaited.discard(id(peer))
        if self._leaving.pop(id(peer), None) is not None:
            self.close(peer, polite=False)

    def stop_reading(self, worker: str, task: str) -> None:
        """Close the leaving streams of ``worker``'s ``task``: it was dropped as dead, and
        this consumer now says what it got from it (a shared job's fence). A worker that
        was only paused would send more on them, which another worker makes again."""
        for peer, _ in list(self._leaving.values()):
            if peer.worker == worker and peer.task == task:
                self.left(peer)

    def expire(self, now: float) -> None:
        """Close the leaving workers whose grace is over."""
        for peer, deadline in list(self._leaving.values()):
            if now >= deadline:
                if id(peer) in self._awaited:
                    log.warning("%s left the job after draining but its END of epoch %s "
                                "did not come within %.0f s: the epoch ends without it",
                                peer.describe(), self.session.epoch, LEAVE_GRACE_SECONDS)
                self.left(peer)
                self.on_gone()

    def opened_on(self, task: str, epoch: int) -> bool:
        """Whether this consumer opened ``epoch`` on ``task`` (the latest epochs')."""
        return (task, epoch) in self._opened

    def awaited(self) -> bool:
        """Whether a worker that left the job cleanly may still send records of the
        epoch: its END has not come yet (see :meth:`update`)."""
        return bool(self._awaited)

    def close(self, peer: Peer, polite: bool) -> None:
        """Stop reading ``peer``: tell it (``polite``), close its socket and its rings."""
        if polite:
            self.send(peer, Command.CLOSE, {})
        if self._poller is not None:
            self._poller.unregister(peer.socket)
        self._by_socket.pop(peer.socket, None)
        peer.socket.close(0)
        for ring in [peer.ring, *peer.old_rings]:
            if ring is not None:
                self._forget_ring(ring)
                ring.close()  # unlinks now; views the user holds stay valid
        peer.old_rings.clear()
        if self._peers.get(peer.worker) is peer:
            del self._peers[peer.worker]
        self.stats.indices = tuple(p.index for p in self._peers.values())
        if peer.doing is not None:  # what it last did, should it turn out to have died
            self.stats.was_doing[peer.pid] = doing_text(peer.doing)

    def close_all(self) -> None:
        """Close every peer, telling each (the consumer is going), and the leaving ones;
        sweep what workers that died left in shared memory (one killed after it ended
        the epoch never left the broker's view before this consumer went)."""
        for peer in list(self._peers.values()):
            self.close(peer, polite=True)
        for peer, _ in self._leaving.values():
            self.close(peer, polite=False)
        self._leaving.clear()
        self._awaited.clear()
        if self.notices is not None:
            self.notices.close()
        sweep()

    # --- streams and credits --------------------------------------------------------------

    def open(self, peer: Peer, keep_credits: bool = False, again: bool = False) -> None:
        """Open the epoch under way (its latest rerun) on ``peer``, granting ``prefetch``
        credits afresh, and its share of the memory budget (the bytes it may have in
        flight to this consumer); ``again``: it was reading the epoch there already (the
        broker had given up on this consumer): say what it had of it (a shared job's)."""
        session, prefetch = self.session, self.settings.prefetch
        parts = self.settings.parts  # (a mix drawn here: prefetch for each input)
        if not keep_credits:
            peer.returned = 0
            peer.part_returned = {}
        peer.owed, peer.heard = prefetch * max(1, parts), time.monotonic()  # granted afresh
        peer.part_owed, peer.ended_parts = dict.fromkeys(range(parts), prefetch), set()
        body = {"job": session.job, "task": peer.task, "consumer": session.consumer,
                "epoch": session.epoch, "credits": prefetch, "rerun": session.rerun,
                "ring": peer.ring.name if peer.ring is not None else None,
                # (by input, no bytes bound: the credits of each input bound its records)
                "window": None if parts else self.budget.window(len(self._peers))}
        if peer.ring is not None and self.notices is not None:
            body.update(notify=self.notices.name, ring_id=peer.ring.ring_id)
        if peer.ring is not None and not parts:
            body["counter"] = self._count_from_here(peer)
        if self.rounds is not None:
            body["consumer_index"] = self.rounds.index
        if session.weights is not None:
            body.update(weights=list(session.weights), weights_stamp=session.weights_stamp)
        if again and session.got_from.get(peer.worker):
            body["had"] = session.got_from[peer.worker]
        if session.branch:
            body["branch"] = session.branch
        # Items kept until done and sent on a stream now lost (the broker gave up on this
        # consumer, or this is another worker of that index): sent again, first.
        kept = session.dispatch_kept.get(peer.index)
        again = bool(kept) and (again or peer.opened != session.epoch)
        if again:
            body["redispatched"] = True
        peer.opened = session.epoch
        if peer.task is not None and session.epoch is not None:
            if len(self._opened) >= MAX_ITEMS:  # (a long run's: the latest epochs count)
                self._opened = {(t, e) for t, e in self._opened if e >= session.epoch}
            self._opened.add((peer.task, session.epoch))
        self.send(peer, Command.OPEN, payload=session.epoch_input.frames(peer.index),
                  body=body)
        if again:
            for items in kept or ():
                self.send(peer, Command.DISPATCH, body={"epoch": session.epoch,
                                                        "items": items})
        for items, keep in session.undispatched.pop(peer.index, ()):
            if keep:
                session.dispatch_kept.setdefault(peer.index, deque()).append(items)
            self.send(peer, Command.DISPATCH, body={"epoch": session.epoch, "items": items})

    def _count_from_here(self, peer: Peer) -> int:
        """Number a new OPEN of ``peer``: its credits count from 0 again in its ring's
        header (written before the OPEN goes: whatever the worker reads there from then on
        is of this OPEN or later)."""
        self._opens = self._opens % RING_COUNT_MASK + 1
        peer.counter, peer.counted = self._opens, 0
        peer.ring.give(credits_word(self._opens, 0))
        return self._opens

    def _counted(self, peer: Peer, credits: int) -> bool:
        """Give ``peer`` back ``credits`` through its ring's header, when its worker takes
        them from there (False: it does not, or not yet: a CREDIT must carry them); a
        CREDIT still goes, carrying none, when the worker waits for credits (its
        ``starving`` word: once per wait, when a CREDIT's worth came since it was seen) or
        segments wait to be let go of."""
        ring = peer.ring
        if peer.counter is None or ring is None or ring.taken() != peer.counter:
            return False
        peer.counted = (peer.counted + credits) & RING_COUNT_MASK
        self._granted(peer, credits, None)
        ring.give(credits_word(peer.counter, peer.counted))
        fence()  # (the worker writes ``starving``, then reads ``credits``: either sees it)
        starving = ring.starving()
        waits = open_of(starving) == peer.counter and starving != peer.woken
        if waits and starving != peer.seen:
            peer.seen, peer.since = starving, (peer.counted - credits) & RING_COUNT_MASK
        # (woken with a CREDIT's worth, as a CREDIT message would have carried them)
        waits = waits and (peer.counted - peer.since) & RING_COUNT_MASK \
            >= self.budget.credit_batch
        if waits or peer.mapped:
            if waits:
                peer.woken = starving
            self.send(peer, Command.CREDIT, {"epoch": self.session.epoch, "credits": 0,
                                             "mapped": peer.mapped})
            peer.mapped = []
        return True

    def peer_at(self, index: int) -> Peer | None:
        """The connected worker of task index ``index``, if any."""
        return next((p for p in self._peers.values() if p.index == index), None)

    def dispatch(self, index: int, items: tuple[int, ...], credits: int = 0,
                 keep: bool = False) -> None:
        """Work items of the epoch under way for the worker of ``index`` (none: it gets
        no more), sent in messages of at most ``MAX_ITEMS``; held for its OPEN while no
        such worker is connected. ``keep``: kept until they are done
        (:meth:`dispatch_done`), and sent again should the stream they went on be lost
        (see :meth:`open`). ``credits``: records of its that were used, given back with
        the items (the first message carries them, and any given back before)."""
        session = self.session
        if session.epoch is None:
            return
        chunks = [list(items[at:at + MAX_ITEMS]) for at in range(0, len(items), MAX_ITEMS)]
        peer = self.peer_at(index)
        if peer is not None:
            peer.returned += credits
        for chunk in chunks or [[]]:
            if peer is None:
                session.undispatched.setdefault(index, []).append((chunk, keep))
                continue
            if keep:
                session.dispatch_kept.setdefault(index, deque()).append(chunk)
            body: dict[str, Any] = {"epoch": session.epoch, "items": chunk}
            if peer.returned:  # (with the first message)
                self._granted(peer, peer.returned, None)
                body["credits"], peer.returned = peer.returned, 0
            self.send(peer, Command.DISPATCH, body)

    def dispatch_done(self, index: int, count: int) -> None:
        """The next ``count`` work items kept for the worker of ``index`` in the epoch
        under way (:meth:`dispatch` with ``keep``) are done: forgotten."""
        log = self.session.dispatch_kept.get(index)
        while log and log[0] and count > 0:  # (an empty one ends them: kept)
            if count >= len(log[0]):
                count -= len(log.popleft())
            else:
                del log[0][:count]
                count = 0

    def reweigh_all(self, weights: tuple[float, ...], stamp: float) -> None:
        """A mix's weights from now on (set at ``stamp``): every peer's later OPENs carry
        them, and the peers of an epoch under way are told at once (WEIGHTS)."""
        self.session.weights, self.session.weights_stamp = weights, stamp
        if self.session.epoch is None:
            return
        for peer in list(self._peers.values()):
            self.send(peer, Command.WEIGHTS, body={"weights": list(weights), "stamp": stamp})

    def open_all(self, keep_credits: bool = False) -> None:
        """Open the epoch under way on every peer."""
        for peer in list(self._peers.values()):
            self.open(peer, keep_credits)

    def credit(self, worker: str, credits: int, part: int | None = None) -> None:
        """Give ``worker`` back ``credits`` (records used; of mix input ``part`` when this
        consumer draws the mix); sent once half the prefetch (that the memory budget
        allows) has come back, or at once when segments wait to be let go of."""
        target = self._peers.get(worker) or self._leaving_of(worker)
        if target is None or self.session.epoch is None:
            return
        if part is None and self._counted(target, target.returned + credits):
            target.returned = 0
            return
        if part is None:
            target.returned += credits
            returned = target.returned
        else:
            returned = target.part_returned[part] = target.part_returned.get(part, 0) + credits
        if returned >= self.budget.credit_batch or target.mapped:
            self._granted(target, returned, part)
            body: dict[str, Any] = {"epoch": self.session.epoch, "credits": returned,
                                    "mapped": target.mapped}
            if part is not None:
                body["part"] = part
                target.part_returned[part] = 0
            else:
                target.returned = 0
            self.send(target, Command.CREDIT, body)
            target.mapped = []

    def _leaving_of(self, worker: str) -> Peer | None:
        """The stream of ``worker`` read on after it left the view (:meth:`update`): it
        sends the rest of what it made for this consumer, then its END, and needs credits
        for those records as before (without them, one that had none left could send
        nothing more until the grace was over)."""
        for peer, _ in self._leaving.values():
            if peer.worker == worker:
                return peer
        return None

    def _granted(self, peer: Peer, credits: int, part: int | None) -> None:
        """``credits`` go to ``peer`` now (of mix input ``part``)."""
        if peer.spendable() <= 0:  # it had none: its silence so far says nothing
            peer.heard = time.monotonic()
        peer.owed += credits
        if part is not None:
            peer.part_owed[part] = peer.part_owed.get(part, 0) + credits

    def fit(self, record_bytes: int) -> None:
        """A record of ``record_bytes`` came, larger than the budget holds ``limit`` of
        from every worker: lower the limit (see :class:`~zloader.client.budget.Budget`)."""
        self.budget.fit(record_bytes, len(self._peers))
        self.large = self.budget.large(len(self._peers))

    def send(self, peer: Peer, command: Command, body: dict[str, Any],
             payload: tuple[Any, ...] | list[Any] = ()) -> None:
        """Send ``peer`` a message, dropped (and logged) when it cannot take it now."""
        try:
            send_frames(peer.socket, encode(command, body, payload), NOBLOCK)
        except zmq.Again:
            log.warning("worker %s is not reachable: %s not sent", peer.endpoint, command.name)

    # --- shared memory --------------------------------------------------------------------

    def ring_of(self, peer: Peer, name: str) -> Any:
        """The ring a DATA refers to by ``name``: the current one or, until the worker has
        switched, a ring it is growing out of (records arrive in order, so once one names
        the current ring the older rings get no more).

        Raises:
            ProtocolError: ``name`` names no ring of ``peer``'s.
        """
        if peer.ring is not None and name == peer.ring.name:
            return self.reading(peer, peer.ring)
        for old in peer.old_rings:
            if old.name == name:
                return old
        raise ProtocolError(f"DATA names ring {name!r}, which this consumer did not open")

    def reading(self, peer: Peer, ring: Any) -> Any:
        """``ring`` (one of ``peer``'s, found already), about to be read: when it is the
        current one, the rings it replaced are let go of (records come in order, so the
        older rings get no more)."""
        if ring is peer.ring and peer.old_rings:
            for old in peer.old_rings:
                self._forget_ring(old)
                old.close()
            peer.old_rings.clear()
        return ring

    def grow_ring(self, peer: Peer, record_bytes: int) -> None:
        """A record of ``record_bytes`` came (or found the ring full): when records are
        large for the ring (fewer than ``prefetch + 2`` fit: those in flight, the one the
        user still holds while asking for the next, and the one being written), replace it
        with one large enough (at least twice as large, at most RING_MAX_BYTES: no larger
        than needed, as each page costs its first writer and reader a fault), if the
        memory budget holds it; else lower the budget's prefetch instead. Its writer
        reserves the new ring's memory, not this thread."""
        assert peer.ring is not None
        capacity = peer.ring.capacity
        needed = record_bytes * (self.budget.limit + RING_BUDGET_SLACK)
        if needed <= capacity or capacity >= RING_MAX_BYTES:
            return
        size = min(RING_MAX_BYTES, max(capacity * 2, -(-needed // RING_ALIGN) * RING_ALIGN))
        held = sum(ring.capacity for _, ring in self._rings.values())
        if not self.budget.may_grow(held, size - capacity):
            self.fit(record_bytes)  # fewer records in flight instead
            return
        bigger = self._give_ring(peer, size)
        if bigger is None:
            return
        if peer.counter is not None:  # (its writer takes them there once it has it)
            bigger.give(credits_word(peer.counter, peer.counted))
        peer.old_rings.append(peer.ring)
        peer.ring = bigger
        self.send(peer, Command.RING, {"ring": bigger.name, "ring_id": bigger.ring_id})

    def map_segment(self, peer: Peer, segment: tuple[str, int], private: bool = False) -> Any:
        """Map a one-record segment; the worker unlinks it once told (next CREDIT). A
        shared job's record is mapped copy-on-write (``private``): writing into an element
        changes this process's copy only.

        Raises:
            ProtocolError: ``segment`` cannot be mapped or is too short.
        """
        from zloader.transport.shm import Segment

        try:
            mapped = Segment.attach(segment[0], private=private)
        except (OSError, ValueError) as exc:
            raise ProtocolError(f"DATA: cannot map segment {segment[0]!r}: {exc}") from None
        if not 0 < segment[1] <= mapped.size:
            mapped.close()
            raise ProtocolError(f"DATA: segment length {segment[1]} out of range")
        block = np.frombuffer(mapped.buf, np.uint8, count=segment[1])
        mapped.close()  # the mapping lives on in ``block`` and the views made from it
        peer.mapped.append(segment[0])
        return block


def make_ring(size: int | None) -> Any:
    """A ring of ``size`` bytes (default: the ring's) to read a co-located worker's records
    from, or None when /dev/shm cannot hold it (that worker's records then come over the
    socket)."""
    from zloader.transport.ring import RingReader
    from zloader.transport.shm import ShmError

    try:
        return RingReader(size or DEFAULT_RING_BYTES)
    except ShmError as exc:
        log.warning("%s; using the socket for this worker instead", exc)
        return None


def local_address(broker: str) -> str:
    """The address of this host's interface that faces the broker (loopback for a local
    broker), so that the broker's workers can reach what this consumer serves."""
    host = broker.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1", "*", ""):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))  # no packet is sent: this only picks a route
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"
