"""A consumer's loop: one object that owns its sockets and protocol state.

:class:`ConsumerLoop` talks to the broker (link.py) and to every worker of the job
(peers.py), decodes records (receive.py), decides when an epoch is over (epoch_end.py)
and hands :data:`~zloader.client.items.Item` s to the iterating thread on a queue. It has
one door: :meth:`ConsumerLoop.step` runs one turn of it (heartbeat, the commands queued by
:meth:`ConsumerLoop.submit`, one poll of every socket and the messages found there,
checks). Whoever calls ``step`` owns the sockets for that turn; the I/O thread
(thread.py) and the turn (turn.py) decide which thread that is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Container
from typing import Any

import zmq

from zloader._defaults import CHECK_SECONDS, NOTICE_HOLD_SECONDS
from zloader.client.epoch_end import EpochEnd
from zloader.client.items import (
    Command,
    DispatchDone,
    DispatchItems,
    Failed,
    GiveCredit,
    Item,
    SetWeights,
    StartEpoch,
)
from zloader.client.link import BrokerLink, registration
from zloader.client.peers import Peer, Peers, local_address
from zloader.client.receive import Receiver
from zloader.client.rounds import Rounds
from zloader.client.session import EpochInput, Session, Settings
from zloader.client.stats import Stats
from zloader.options import JobOptions
from zloader.shipping import Served
from zloader.transport import messages
from zloader.transport.keys import Keys
from zloader.transport.protocol import Message, ProtocolError, decode
from zloader.transport.sockets import make_socket, waiting

__all__ = ["ConsumerLoop"]

log = logging.getLogger("zloader.loader")


class ConsumerLoop:
    """A consumer's sockets, rings and protocol state, and the loop that serves them.

    ``blob`` is the pickled pipeline sent with REGISTER; empty when ``served`` holds it
    (too large for the broker: workers fetch it from this loop's source socket) or when
    the workers inherited it (embedded, fork). ``options`` are the job's, built by the
    Loader; ``consumer_index`` is this consumer's in a coordinated job; ``prefix``: a
    shared job's pipeline's prefixes (zloader/sharing/branches.py ``prefix_of``). The
    other arguments are the Loader's.
    """

    def __init__(self, address: str, blob: bytes, *, fingerprint: str, job_name: str | None,
                 options: JobOptions, source: dict[str, Any], prefetch: int,
                 use_rings: bool, ring_bytes: int | None, served: Served | None = None,
                 data_bind: str | None = None, consumer_index: int | None = None,
                 keys: Keys | None = None, resume: dict[str, Any] | None = None,
                 timeout: float = 60.0, own: Container[int] = frozenset(),
                 memory_budget: int | None = None, dispatched: bool = False,
                 parts: int = 0, made_here: int = 0,
                 prefix: dict[str, Any] | None = None) -> None:
        coordinated = ((options.num_consumers, consumer_index or 0) if options.coordinated
                       else None)
        self.settings = Settings(
            address=address, prefetch=prefetch, timeout=timeout, use_rings=use_rings,
            ring_bytes=ring_bytes, keys=keys, data_bind=data_bind,
            balanced=options.balanced > 0, exactly_once=options.exactly_once,
            coordinated=coordinated, fixed=options.sharding in ("static", "off"),
            own=own if options.objects else frozenset(), memory_budget=memory_budget,
            width=max(1, options.num_workers), named=job_name is not None,
            dispatched=dispatched, parts=parts, made_here=made_here)
        self.served = served or Served()
        self._left: dict[str, Any] | None = None  # (Bye.left: leaving)
        register = registration(
            fingerprint=fingerprint, job_name=job_name, options=options,
            consumer_index=consumer_index if options.coordinated else None, source=source,
            inherited=not blob and self.served.pipeline is None, resume=resume,
            prefix=prefix)
        self.items: queue.Queue[Item] = queue.Queue()  # to the iterating thread
        self.stats = Stats(width=max(1, options.num_workers))
        # Each worker index reads its own part (static sharding, a deterministic order): an
        # index without a worker stalls the epoch however many other workers serve it.
        self._indexed = options.sharding == "static" or options.deterministic
        # Set once the broker's first answer came (the job's epoch is known) or the job
        # failed: what Merger.job_epoch waits for.
        self.answered = threading.Event()
        self._session = Session(consumer=register.consumer)
        self._rounds = Rounds(coordinated) if coordinated else None
        self._link = BrokerLink(self.settings, self._session, self.stats, register, blob,
                                self._rounds, self.put)
        self._peers = Peers(self.settings, self._session, self.stats, self._rounds)
        self.budget = self._peers.budget  # (read by the iterating thread: credit batches)
        self._end = EpochEnd(self.settings, self._session, self.stats, self._link,
                             self._peers, self._rounds, self.put, register.resume)
        self._peers.on_gone = self._end.check
        self._receiver = Receiver(self._session, self.stats, self._peers, self._link,
                                  self._end, self._rounds, self.put)
        self._init_turns()

    def _init_turns(self) -> None:
        """The state of the loop's turns: the commands queued and the pipe that wakes the
        loop for them, its sockets (made when it starts), when its periodic work is due
        next and when a dropped message was last logged."""
        self._rejected_logged = 0.0  # when a dropped message was last logged
        self._commands: deque[Command] = deque()
        # A command wakes the loop at once (a byte in this pipe) instead of at its next
        # poll. The pipe is closed once the loop has stopped, so writers need no lock.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._context: zmq.Context[Any] | None = None
        self._broker: zmq.Socket[Any] | None = None
        self._data_server: zmq.Socket[Any] | None = None
        self._guard: Any = None  # the ZAP handler, with keys and a source socket
        self._poller: zmq.Poller | None = None  # (set once the sockets exist)
        self._next_beat = 0.0
        self._next_check = 0.0  # when leaving workers are looked at next
        self._next_stuck = 0.0  # ... and stuck ones (EpochEnd.check_stuck says when)

    # --- the door -------------------------------------------------------------------------

    def put(self, item: Item) -> None:
        """Hand the iterating thread ``item``."""
        self.items.put(item)
        if isinstance(item, Failed):
            self.answered.set()  # (a job_epoch() waiting must see the failure)

    def submit(self, command: Command, wake: bool = True) -> None:
        """Queue ``command`` for the next step (from any thread), waking the loop's poll
        unless ``wake`` is False (it can wait for the next step)."""
        self._commands.append(command)
        if wake:
            self.wake()

    def wake(self) -> None:
        """End the poll of the step under way (from any thread)."""
        if self._wake_write < 0:
            return  # closed: nobody reads it any more
        with contextlib.suppress(OSError):  # BlockingIOError: a wake-up is pending anyway
            os.write(self._wake_write, b"!")

    @property
    def running(self) -> bool:
        """Whether the sockets exist (between :meth:`open` and :meth:`close`)."""
        return self._poller is not None

    def open(self) -> None:
        """Make the sockets, in a fresh ZeroMQ context of this loop's own."""
        context = self._context = zmq.Context()
        poller = zmq.Poller()
        self._broker = self._link.connect(context)
        poller.register(self._broker, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        self._peers.attach(context, poller)
        if self.served:
            self._serve_source(context, poller)
        self._poller = poller

    def step(self, poll_ms: int) -> None:
        """One turn of the loop: heartbeat, commands, one poll of every socket (waiting
        up to ``poll_ms``) and the messages it finds, acks, checks. The caller owns the
        sockets for its duration."""
        assert self._poller is not None
        session, now = self._session, time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + session.heartbeat
            self._link.beat()
            if session.job is not None and self._rounds is not None and not session.done:
                self._link.acks += self._rounds.uncommitted()  # in case one was lost
        while self._commands:
            self._run_all()
        notices = self._peers.notices
        for sock, _ in self._poller.poll(poll_ms):
            if sock == self._wake_read:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_read, 4096):
                        pass
                continue
            if notices is not None and sock == notices.fd:
                self._notices()
                continue
            for frames in waiting(sock, 64):  # (a message may close its peer's socket)
                self._receive(sock, frames)
        self._link.send_acks()
        now = time.monotonic()
        # (each looks at every worker: not at every step, which is once per record)
        if now >= self._next_stuck:
            self._next_stuck = self._end.check_stuck(now)
        if now >= self._next_check:
            self._next_check = now + CHECK_SECONDS
            self._peers.expire(now)
            self._release_held(now)

    def leaving(self, left: dict[str, Any] | None) -> None:
        """What the BYE that :meth:`close` sends says was yielded of the epoch under way
        (``Bye.left``; the Loader's, as it closes)."""
        self._left = left

    def close(self) -> None:
        """Tell the workers and the broker this consumer leaves, close every socket and
        end the context; the wake pipe closes too."""
        self._poller = None
        if self._context is not None:
            if self._data_server is not None:
                self._data_server.close(0)
            self._peers.close_all()
            self._link.bye(self._left)
            if self._guard is not None:
                self._guard.stop()
            self._context.term()
            self._context = None
        self.close_pipe()

    def close_pipe(self) -> None:
        """Close the wake pipe (safe twice; its fds go now, not at collection)."""
        fds = (getattr(self, "_wake_read", -1), getattr(self, "_wake_write", -1))
        self._wake_read = self._wake_write = -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def drop_items(self) -> None:
        """Drop the records nobody will read: their elements are views into the rings,
        whose mappings (and descriptors) would otherwise live until this object is
        collected."""
        with contextlib.suppress(queue.Empty):
            while True:
                self.items.get_nowait()

    def __del__(self) -> None:
        self.close_pipe()

    # --- what the iterating thread may read -----------------------------------------------

    @property
    def registration(self) -> dict[str, Any]:
        """The body of this consumer's REGISTER (its ``consumer`` id, ``source_data``)."""
        return messages.encode(self._link.register)

    @property
    def job(self) -> str | None:
        """The job's id, once the broker has answered (None again when it forgot it)."""
        return self._session.job

    def peers(self) -> list[Peer]:
        """The workers that serve the job now, as this consumer sees them."""
        return list(self._peers)

    def stall_reason(self, silent: float) -> str:
        """Why no data came for ``silent`` seconds, as far as this consumer can tell."""
        address = self.settings.address
        peers = list(self._peers)
        if self._session.job is None:
            keys = ("; with keys, are they the broker's?" if self.settings.keys is not None
                    else "; does it want keys (keys= or ZLOADER_KEYS)?")
            return (f"no broker answered at {address} for {silent:.0f} s: is "
                    f"zloader-broker running there{keys} (raise timeout= to wait longer)")
        busy, lost = self._link.busy_elsewhere, self._peers.lost
        if not peers and busy and not lost:
            return (f"no worker has served this job for {silent:.0f} s: the broker's "
                    f"{busy} workers all run other jobs (a worker serves one "
                    "job at a time): start more workers (zloader-worker --broker "
                    f"{address}), pass num_workers=, or close the other Loaders first")
        if not peers:
            last = (f"; the last one, {lost}, was taken off the job"
                    if lost else "; every worker may have died")
            return (f"no worker has served this job for {silent:.0f} s: start workers "
                    f"(zloader-worker --broker {address}) or pass num_workers={last} "
                    "(raise timeout= to wait longer)")
        missing = sorted(set(range(self.stats.width)) - {p.index for p in peers}) \
            if self._indexed else []
        if missing:
            where = (f"the broker's {busy} other workers run other jobs (one whose "
                     "worker indices are fixed, as a torch DataLoader's, keeps its workers "
                     "until its epoch ends)" if busy else "the broker has no free worker")
            return (f"no data for {silent:.0f} s: worker index "
                    f"{', '.join(map(str, missing))} of this job's {self.stats.width} has "
                    f"no worker, and {where}: start more workers (zloader-worker --broker "
                    f"{address}), pass a smaller num_workers=, or let the other Loaders end "
                    "their epochs first")
        if self._rounds is not None and self._rounds.vacant:
            return (f"no data for {silent:.0f} s: coordinated reads wait for consumer_index "
                    f"{', '.join(map(str, self._rounds.vacant))} of {self._rounds.size} "
                    "to join")
        waiting_on = [p for p in peers if p.worker not in self._session.ended]
        if waiting_on:
            quiet = min(waiting_on, key=lambda p: p.heard)
            held = quiet.spendable()
            why = (f" though it holds {held} credits of this consumer: its user code "
                   "may be blocked (a deadlock, a wait that never ends) or its process "
                   "stopped" if held > 0 else "")
            return (f"no data from the job's {len(peers)} workers for {silent:.0f} s; "
                    f"{quiet.describe()} has sent nothing for "
                    f"{time.monotonic() - quiet.heard:.0f} s{why} (raise timeout= if one "
                    "element can take longer)")
        return (f"no data from the job's {len(peers)} workers for {silent:.0f} s "
                "(raise timeout= to wait longer)")

    # --- inside the loop ------------------------------------------------------------------

    def _run_all(self) -> None:
        """Run the commands waiting, in order. Credits given back to a worker that gets
        items among them go with its first items (one DISPATCH instead of a DISPATCH and
        a CREDIT: the torch drop-in hands a worker its next batch as it yields one of its
        batches), unless an epoch starts among them or the worker's mapped segments must
        be named (a CREDIT names them)."""
        commands: list[Command | None] = [self._commands.popleft()
                                          for _ in range(len(self._commands))]
        folded: dict[int, int] = {}  # a DispatchItems' place -> the credits it carries
        if not any(isinstance(command, StartEpoch) for command in commands):
            self._fold(commands, folded)
        for at, command in enumerate(commands):
            if command is not None:
                self._run(command, folded.get(at, 0))

    def _fold(self, commands: list[Command | None], folded: dict[int, int]) -> None:
        """Each GiveCredit (of no mix input) for a worker that a DispatchItems of
        ``commands`` goes to joins the first such DispatchItems (its place in ``folded``)
        and leaves ``commands`` (None in its place)."""
        first: dict[str, int] = {}  # a worker id -> the place of its first DispatchItems
        for at, command in enumerate(commands):
            if isinstance(command, DispatchItems):
                peer = self._peers.peer_at(command.worker)
                if peer is not None and not peer.mapped:
                    first.setdefault(peer.worker, at)
        if not first:
            return
        for at, command in enumerate(commands):
            if isinstance(command, GiveCredit) and command.part is None \
                    and command.worker in first:
                place = first[command.worker]
                folded[place] = folded.get(place, 0) + command.credits
                commands[at] = None

    def _run(self, command: Command, credits: int = 0) -> None:
        if isinstance(command, GiveCredit):
            self._peers.credit(command.worker, command.credits, command.part)
        elif isinstance(command, StartEpoch):
            self._start(command.epoch, command.frames)
        elif isinstance(command, SetWeights):
            self._peers.reweigh_all(command.weights, command.stamp)
        elif isinstance(command, DispatchItems):
            self._peers.dispatch(command.worker, command.items, credits, command.keep)
        elif isinstance(command, DispatchDone):
            self._peers.dispatch_done(command.worker, command.items)

    def _start(self, epoch: int, epoch_input: EpochInput) -> None:
        """Begin ``epoch``: tell the broker, open it on every worker."""
        self._session.start(epoch, epoch_input, self.settings.made_here)
        self._end.start()
        self._receiver.start()
        self.stats.last_progress = time.monotonic()  # the timeout counts from the start
        if self._rounds is not None:
            self._rounds.start(epoch)
        if self._session.job is not None:
            self._link.ask_epoch()
        self._peers.open_all()

    def _receive(self, sock: zmq.Socket[Any], frames: list[zmq.Frame]) -> None:
        """Decode and handle one message from outside: whatever is wrong with it (malformed,
        hostile, or a bug its handling hits) drops it, counted in ``rejected`` and logged,
        and the loop goes on serving the consumer."""
        try:
            if sock is self._broker:
                self._from_broker(decode(frames))
            elif sock is self._data_server:
                self._fetch(frames)
            else:
                # Records a worker announced on the pipe before this message come first.
                self._notices()
                msg = decode(frames)
                peer = self._peers.of(sock)
                if peer is not None:
                    self._receiver.message(peer, msg)
        except ProtocolError as exc:
            self._reject(f"dropped a malformed message: {exc}")
        except Exception:  # a bug must not stop the consumer: log it, drop the message
            self._reject("failed on a message; dropped it", exc_info=True)

    def _notices(self) -> None:
        """Take the records whose notices wait on the pipe (transport/notice.py), all of
        them, in the order their workers wrote them; a malformed one is dropped and
        counted as a malformed message is."""
        notices = self._peers.notices
        if notices is None:
            return
        for notice in notices.read():
            try:
                self._receiver.notice(*notice)
            except ProtocolError as exc:
                self._reject(f"dropped a malformed record notice: {exc}")
            except Exception:  # a bug must not stop the consumer: log it, drop the record
                self._reject("failed on a record notice; dropped it", exc_info=True)

    def _release_held(self, now: float) -> None:
        """Take the records held back longer than NOTICE_HOLD_SECONDS for a DATA message
        before them (transport/notice.py): it was lost on the way."""
        for peer in self._peers:
            if peer.deferred:
                try:
                    self._receiver.release(peer, False, older=now - NOTICE_HOLD_SECONDS)
                except ProtocolError as exc:
                    self._reject(f"dropped a malformed record notice: {exc}")

    def _reject(self, text: str, exc_info: bool = False) -> None:
        """Count a dropped message; log it at most once a second (a flood of junk must
        not flood the trainer's log)."""
        self.stats.rejected += 1
        now = time.monotonic()
        if now - self._rejected_logged >= 1.0:
            self._rejected_logged = now
            log.warning("%s (%d rejected so far)", text, self.stats.rejected,
                        exc_info=exc_info)

    def _from_broker(self, msg: Message) -> None:
        """One message from the broker, its body decoded into its record.

        Raises:
            ProtocolError: it is malformed.
        """
        record = messages.decode(msg)
        if isinstance(record, messages.Job):
            self._job_view(record)
        elif isinstance(record, messages.Error):
            self._link.refused(record)
        elif isinstance(record, messages.Log):
            self._link.log_lines(record)
        elif isinstance(record, messages.Commit):
            if self._rounds is not None:
                self._rounds.total_lost = record.total_lost
                self.stats.rounds_lost = self._rounds.total_lost
                if record.epoch == self._session.epoch:
                    self._rounds.commit(list(record.rounds), list(record.lost))
                    self._end.release_rounds()
        elif isinstance(record, messages.Unknown):
            self._link.forgotten()

    def _job_view(self, job: messages.Job) -> None:
        """JOB: the link takes the job's facts, the peers follow its workers, the end of
        the epoch takes its fences and confirmations. The broker's traffic is no progress:
        only data is (a stuck worker heartbeats)."""
        view = self._link.job(job)
        if self.stats.job_epoch is not None:
            self.answered.set()
        # (before the peers follow the view: a worker gone ends the epoch unless a fence
        # holds it, and this view's fences are the ones that count)
        self._end.pending, self._end.fencing = view.pending, view.fencing
        known = self._peers.workers()
        self._peers.update(view.workers, {entry["task"] for entry in view.drained})
        confirmed = self._end.view(view)
        session = self._session
        if view.registered and session.epoch is not None and not session.done:
            # The epoch began before the job was known (the first view came after
            # iteration started): tell the broker now, which places workers for a job
            # that reads. Registered again mid-epoch (the broker had given up on this
            # consumer, or restarted): the workers dropped its streams, so open the
            # epoch again.
            self._link.ask_epoch()
            for worker in known & self._peers.workers():
                peer = self._peers.get(worker)
                if peer is not None:
                    self._peers.open(peer, again=True)
        self._end.check(confirmed=confirmed)

    def _serve_source(self, context: zmq.Context[Any], poller: zmq.Poller) -> None:
        """Bind the socket from which workers fetch this job's in-memory source data and
        its pipeline, when that is too large to pass through the broker."""
        keys = self.settings.keys
        if keys is not None:
            self._guard = keys.guard(context)
        server = make_socket(context, zmq.ROUTER, keys, serve=True)
        server.bind(self.settings.data_bind
                    or f"tcp://{local_address(self.settings.address)}:*")
        self._data_server = server
        poller.register(server, zmq.POLLIN)
        self._link.amend(**self.served.fields(server.getsockopt_string(zmq.LAST_ENDPOINT)))

    def _fetch(self, frames: list[zmq.Frame]) -> None:
        assert self._data_server is not None
        reply = self.served.answer(decode(frames[1:]))
        self._data_server.send_multipart([frames[0].bytes, *reply], copy=False)
