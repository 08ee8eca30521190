"""When a consumer's epoch is over: every worker ended it, no dead worker's splits wait
(fences, reruns), and, for an exactly-once job, nothing the broker handed out is missing
from what was received (else those splits are read again). Also the consumer's answers
to fences and its reports of stuck workers (docs/reliability.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from zloader._defaults import CHECK_SECONDS, REREADS
from zloader.client.items import Data, Done, Failed, Item
from zloader.client.link import BrokerLink, JobView
from zloader.client.peers import Peers
from zloader.client.rounds import Rounds
from zloader.client.session import Session, Settings
from zloader.client.stats import Stats
from zloader.errors import Timeout, ZloaderError
from zloader.transport import messages

__all__ = ["REREADS", "EpochEnd"]

log = logging.getLogger("zloader.loader")


class EpochEnd:
    """Decides when the epoch under way is over and hands the iterating thread :class:`Done`
    (through ``put``); keeps the exactly-once bookkeeping that decision needs."""

    def __init__(self, settings: Settings, session: Session, stats: Stats, link: BrokerLink,
                 peers: Peers, rounds: Rounds | None, put: Callable[[Item], None],
                 resume: dict[str, Any] | None) -> None:
        self.settings = settings
        self.session = session
        self.stats = stats
        self.link = link
        self.peers = peers
        self.rounds = rounds
        self.put = put
        self.resume = resume  # {epoch, delivered}: what was received before a restart
        # From the job's latest view: epoch -> splits waiting to be read again, epoch ->
        # fences holding it, the job's consumer count, and (exactly-once) the splits the
        # broker handed out in the epoch (its answer to EPOCH).
        self.pending: dict[str, Any] = {}
        self.fencing: dict[str, Any] = {}
        self.consumers = 1
        self.read: list[Any] | None = None
        self._confirming = False  # asked the broker whether the epoch's splits are all done
        self._confirm_asked = 0.0  # when this consumer last sent EPOCH to confirm
        self._draining = False  # the epoch has ended but for rounds not yet released
        self._rereads: dict[tuple[tuple[int, ...], int], int] = {}  # split -> times asked
        self._short_failed = False  # the epoch ended short for good (raised once)
        self._answered: dict[str, float] = {}  # fences this consumer answered -> when
        self._dead_fence: dict[tuple[str, str], str] = {}  # (dead worker, task) -> its fence
        self._drained: tuple[dict[str, Any], ...] = ()  # the latest JOB.drained

    def start(self) -> None:
        """The session began a new epoch: forget the last one's end."""
        self._confirming = self._draining = self._short_failed = False
        self.read, self._rereads, self._dead_fence = None, {}, {}
        self._await_handed()
        resume, session = self.resume, self.session
        if resume is not None and resume["epoch"] == session.epoch:
            session.received.merge_json(resume["delivered"])  # held before the restart

    def view(self, view: JobView) -> bool:
        """Take the rest of a JOB view (after the peers took its workers): answer its
        fences, keep its fencing, consumer count and reads. Returns whether it confirms
        the epoch's end: an exactly-once epoch is confirmed only by the answer to EPOCH,
        which says what was read in it (the epoch is checked against that)."""
        self.answer_fences(view.fences)
        self._drained = view.drained
        self._await_handed()
        self.fencing = view.fencing
        if view.consumers is not None:
            self.consumers = view.consumers
        confirmed = self._confirming
        if view.read is not None:
            self.read = view.read
        elif self.settings.exactly_once:
            confirmed = False
        return confirmed

    def _await_handed(self) -> None:
        """A shared job's tasks that left it cleanly and handed splits of the epoch under
        way on (``JOB.drained``), which this consumer never opened the epoch on: it waits
        for their taker's END, which names the task (the taker makes those splits again
        for it; its OPEN there may have come before the handover did)."""
        session = self.session
        if self.stats.share is None or session.done or session.epoch is None:
            return
        for entry in self._drained:  # (checked by the JOB record)
            task, taker = entry["task"], entry.get("taker")
            if taker and session.awaiting.get(task) == "":
                session.awaiting[task] = taker  # (END.handed's: not once its taker left)
            elif taker and session.epoch in entry.get("epochs", ()) \
                    and not self.peers.opened_on(task, session.epoch):
                session.awaiting.setdefault(task, taker)

    # --- the end --------------------------------------------------------------------------

    def check(self, confirmed: bool = False) -> None:
        """End the epoch once every worker ended it, those that drained away included
        (``Peers.awaited``). With dynamic sharding the broker must also confirm that no
        split of the epoch waits to be re-run (a dead worker's); if some do, the live
        workers run the epoch again for them (a rerun)."""
        session, rounds = self.session, self.rounds
        if session.done or session.epoch is None or not len(self.peers) \
                or self.peers.awaited():
            return
        if self.settings.fixed:
            ended = {self.peers.index_of(w) for w in session.ended}
            if len(ended - {None}) < self.stats.width:
                return
            if rounds is None:
                self.finish()
                return
        elif rounds is not None:  # every worker ended the epoch's latest rerun
            if not all(rounds.ends.get(w, -1) >= session.rerun for w in self.peers.workers()):
                return
        elif not all(peer.worker in session.ended for peer in self.peers):
            return
        if int(self.fencing.get(str(session.epoch), 0)):
            return  # a dead worker's splits are about to be re-queued (made again): wait
        if self.stats.share is not None:  # a shared job's epoch is what its workers produced
            workers = self.peers.workers()  # ("" waits for any: END.handed)
            if not any(fence not in session.acked and (not taker or taker in workers)
                       for fence, taker in session.awaiting.items()):
                self.finish()  # (and what a worker made again of a dead one's: handover.py)
            return
        if not confirmed:
            now = time.monotonic()
            # An exactly-once epoch waits for an answer to EPOCH: ask again when the last
            # one came while a fence held the epoch, or was lost.
            if not self._confirming or (self.settings.exactly_once
                                        and now - self._confirm_asked > session.heartbeat):
                self._confirming, self._confirm_asked = True, now
                self.link.ask_epoch()
            return
        self._confirming = False
        pending = int(self.pending.get(str(session.epoch), 0))
        if rounds is not None:
            self._check_rounds(rounds, pending)
            return
        if pending == 0:
            if not self._short():
                self.finish()
            return
        session.rerun += 1  # a dead worker's splits wait: the workers run the epoch again
        session.ended = set()
        self.peers.open_all(keep_credits=True)

    def _check_rounds(self, rounds: Rounds, pending: int) -> None:
        """The end of a coordinated epoch the broker confirmed. The broker orders its
        reruns, once for all its consumers: each deciding alone, at another moment, they
        would read different rounds."""
        ordered = int(rounds.reruns.get(str(self.session.epoch), 0))
        if ordered > self.session.rerun:
            self.session.rerun = ordered
            self.peers.open_all(keep_credits=True)
            return
        if pending > 0:
            return  # the broker orders a rerun on a confirmation: ask again next beat
        if not rounds.finished(self.session.epoch):
            self._draining = True  # rounds still to commit or to arrive
            return
        self.finish()

    def _short(self) -> bool:
        """Whether an exactly-once epoch that every worker ended lacks elements, checked
        against what its records said (each split's count) and what the broker handed out:
        records can be lost on the way (a segment its worker unlinked while this consumer
        was stalled, records another peer took with its token). The job's only consumer
        (of a job without a name: another may join a named one at any time) asks for the
        splits concerned again, less what it holds (``HEARTBEAT.reread``),
        then for the epoch's state again; after REREADS tries it raises. True: the epoch
        must not end now."""
        if self._short_failed:
            return True
        session = self.session
        # A named job's consumer may count itself alone while another, just joining, took
        # some of the epoch: what it lacks went there, and reading it again would repeat it.
        if not self.settings.exactly_once or self.consumers != 1 or self.settings.named \
                or session.epoch is None:
            return False
        missing = session.received.missing(session.epoch, self.read)
        if not missing:
            return False
        where = ", ".join(f"{split} (pass {list(key)})" for key, split in sorted(missing)[:8])
        if any(self._rereads.get(at, 0) >= REREADS for at in missing):
            self._short_failed = True
            self.put(Failed(ZloaderError(
                f"epoch {session.epoch} ended short: elements of splits {where} never "
                f"reached this consumer ({len(missing)} splits), and {REREADS} readings "
                "again did not bring them; records are being lost on the way (see the "
                "warnings: malformed DATA, another peer with this consumer's keys reading "
                "its stream)")))
            return True
        log.warning("epoch %d ended short of elements of %d splits (%s): reading them "
                    "again", session.epoch, len(missing), where)
        for at in missing:
            self._rereads[at] = self._rereads.get(at, 0) + 1
        self.link.reread = [[list(key), split, session.received.info(key, split)]
                            for key, split in sorted(missing)]
        self.link.heartbeat()  # before the EPOCH, which then finds them pending
        self._confirming, self._confirm_asked = True, time.monotonic()
        self.link.ask_epoch()
        return True

    def release_rounds(self) -> None:
        """Hand the iterating thread every round now in order and committed; drop the
        lost ones (giving their credits back)."""
        assert self.rounds is not None
        for item in self.rounds.release():
            if isinstance(item, Data):
                self.put(item)
            else:
                self.peers.credit(item.worker, 1)
        if self._draining and not self.session.done \
                and self.rounds.finished(self.session.epoch):
            self.finish()

    def finish(self) -> None:
        """The epoch is over: hand on :class:`Done`."""
        self.session.done = True
        epoch = self.session.epoch
        self.put(Done(epoch if epoch is not None else -1))

    # --- dead and stuck workers -----------------------------------------------------------

    def answer_fences(self, fences: Iterable[dict[str, Any]]) -> None:
        """A worker of an exactly-once job died: this consumer reads nothing more from it
        (it left the job's view, so its peer is closed; a shared job's, read on for a
        grace, is closed now: :meth:`Peers.stop_reading`) and tells the broker which elements
        of its splits it holds; the broker hands the splits out again less those. It
        answers again, once a heartbeat, while the fence still lists it as ``waiting``
        (its answer was lost: the broker had dropped it, or stalled). A shared job's
        consumer says how many elements it got from the worker in its epoch; the fence's
        ``taker`` makes the rest again for it and names the fence in its END, which it
        then waits for (zloader/sharing/handover.py)."""
        now = time.monotonic()
        for fence in fences:  # checked by the JOB record
            if not self._asked(fence, now) \
                    or any(p.worker == fence["worker"] and p.task == fence["task"]
                           for p in self.peers):
                continue
            self._answered[fence["id"]] = now
            session = self.session
            assert session.job is not None  # fences come in the job's views
            if self.stats.share is not None:  # what it got from that worker this epoch
                self.peers.stop_reading(fence["worker"], fence["task"])
                answer: dict[str, Any] = {"epoch": session.epoch or 0, "done": session.done,
                          "count": session.got_from.get(fence["worker"], 0)}
                places = session.places(fence["worker"])
                if places is not None:
                    answer["ranges"] = places
                self.link.send(messages.Delivered(
                    job=session.job, fence=fence["id"], splits=(), shared=answer))
                if not session.done and fence.get("taker") and any(
                        key[0] == session.epoch for key, _ in fence["splits"]):
                    # (a restarted broker fences the dead worker again, under a new id:
                    # the old one's taker never names it)
                    dead = (fence["worker"], fence["task"])
                    session.awaiting.pop(self._dead_fence.get(dead, ""), None)
                    self._dead_fence[dead] = fence["id"]
                    session.awaiting[fence["id"]] = fence["taker"]
                continue
            held = tuple((tuple(key), split, info)
                         for key, split, info in self._held(fence["splits"]))
            self.link.send(messages.Delivered(job=session.job, fence=fence["id"],
                                              splits=held))

    def _held(self, entries: list[Any]) -> list[Any]:
        """For each ``[pass key, split]`` of a fence: what this consumer holds of it."""
        session = self.session
        splits = []
        for entry in entries:  # [pass key, split], checked by the JOB record
            key, split = tuple(entry[0]), entry[1]
            if session.epoch is None or key[0] > session.epoch:
                info: dict[str, Any] = {"have": ""}
            elif key[0] < session.epoch or session.done:
                info = {"all": True}  # an epoch this consumer has finished
            else:
                info = session.received.info(key, split)
            splits.append([list(key), split, info])
        return splits

    def _asked(self, fence: dict[str, Any], now: float) -> bool:
        """Whether to answer ``fence``: never answered, or still ``waiting`` for this
        consumer a heartbeat after its last answer."""
        answered = self._answered.get(fence["id"])
        if answered is None:
            return True
        return (self.session.consumer in fence.get("waiting", ())
                and now - answered >= self.session.heartbeat)

    def check_stuck(self, now: float) -> float:
        """A worker that has sent nothing for ``timeout`` seconds though it holds credits
        of this consumer's epoch is stuck (user code blocked on its producer thread while
        its main loop heartbeats, or the process stopped): tell the broker at once, which
        takes it off the job so that its splits go to the other workers. With no other
        worker to take them, the epoch cannot finish: raise :class:`Timeout` naming it.
        Jobs whose workers may rightly hold back for another consumer (shared, balanced,
        coordinated) or for this one's dispatches (a worker with credits may have no work
        item) are bounded by the Loader's overall timeout only.

        Returns the earliest time a worker can be stuck next (a worker is heard from later,
        never earlier, and a new one is heard from as it comes), before which the check
        has nothing to find: the loop need not look at every worker at every step, and
        looks again in time (the iterating thread's own timeout, over the same silence,
        must not come first)."""
        session, timeout = self.session, self.settings.timeout
        if session.done or session.epoch is None or session.job is None \
                or self.settings.balanced or self.settings.dispatched \
                or self.stats.share is not None \
                or self.rounds is not None:
            return now + CHECK_SECONDS
        due = now + timeout
        for peer in self.peers:
            due = min(due, max(peer.heard, peer.reported) + timeout)
            silent = now - peer.heard
            if peer.worker in session.ended or peer.spendable() <= 0 or silent <= timeout \
                    or now - peer.reported <= timeout or peer.task is None:
                continue
            peer.reported = now  # once per timeout
            self.link.stuck.append({"worker": peer.worker, "task": peer.task,
                                    "seconds": round(silent, 3)})
            self.link.heartbeat()
            about = (f"{peer.describe()} sent nothing for {silent:.0f} s though it held "
                     f"{peer.spendable()} credits of this consumer")
            self.peers.lost = about
            if any(p is not peer for p in self.peers):
                log.warning("%s: its user code may be blocked; the broker takes it off the "
                            "job and the other workers read its splits", about)
                self.stats.last_progress = now  # the rerun gets a full timeout of its own
                continue
            self.put(Failed(Timeout(
                f"{about}: its user code may be blocked (a deadlock, a wait that never "
                "ends) and no other worker serves this job to read its splits; the broker "
                "takes it off the job (raise timeout= if one element can take longer)")))
        return due
