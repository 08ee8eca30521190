"""The Loader's I/O thread: owns every socket of a consumer and runs its loop.

It talks to the broker (zloader/client/link.py) and to every worker of the job
(peers.py), decodes records (receive.py), decides when an epoch is over (epoch_end.py)
and puts :class:`Item` s on a queue for the iterating thread, which reads the counters
and the job's facts in one record (:class:`Stats`). The iterating thread sends it
commands (:meth:`IOThread.start_epoch`, :meth:`IOThread.credit`) through a deque.

**The turn** (turn.py): one step of the loop runs under a lock, and whoever holds it owns
the sockets. The iterating thread steps the loop itself while it waits for data
(:meth:`IOThread.take`); the I/O thread steps it otherwise: it reads ahead while the
trainer computes, sends heartbeats and acks, and runs the loop before the first epoch and
after the last. Both run the same :meth:`IOThread._step`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any

import zmq

from zloader._defaults import POLL_MS
from zloader.client.epoch_end import EpochEnd
from zloader.client.items import Item
from zloader.client.link import BrokerLink, registration
from zloader.client.peers import Peer, Peers, local_address
from zloader.client.receive import Receiver
from zloader.client.rounds import Rounds
from zloader.client.session import Session, Settings
from zloader.client.stats import Stats
from zloader.client.turn import Turn
from zloader.options import JobOptions
from zloader.shipping import Served
from zloader.transport import messages
from zloader.transport.keys import Keys
from zloader.transport.protocol import Message, ProtocolError, decode
from zloader.transport.sockets import make_socket, waiting

__all__ = ["IOThread"]

log = logging.getLogger("zloader.loader")


class IOThread(threading.Thread):
    """A consumer's sockets, rings and protocol state, in a thread of their own.

    ``blob`` is the pickled pipeline sent with REGISTER; empty when ``served`` holds it
    (too large for the broker: workers fetch it from this thread's source socket) or when
    the workers inherited it (embedded, fork). ``options`` are the job's, built by the
    Loader; ``consumer_index`` is this consumer's in a coordinated job. The other
    arguments are the Loader's.
    """

    def __init__(self, address: str, blob: bytes, *, fingerprint: str, job_name: str | None,
                 options: JobOptions, source: dict[str, Any], prefetch: int,
                 use_rings: bool, ring_bytes: int | None, served: Served | None = None,
                 data_bind: str | None = None, consumer_index: int | None = None,
                 keys: Keys | None = None, resume: dict[str, Any] | None = None,
                 timeout: float = 60.0, own: frozenset[int] = frozenset()) -> None:
        super().__init__(name="zloader-loader-io", daemon=True)
        coordinated = ((options.num_consumers, consumer_index or 0) if options.coordinated
                       else None)
        self.settings = Settings(
            address=address, prefetch=prefetch, timeout=timeout, use_rings=use_rings,
            ring_bytes=ring_bytes, keys=keys, data_bind=data_bind,
            balanced=options.balanced > 0, exactly_once=options.exactly_once,
            coordinated=coordinated, fixed=options.sharding in ("static", "off"),
            own=own if options.objects else frozenset())
        self.served = served or Served()
        register = registration(
            fingerprint=fingerprint, job_name=job_name, options=options,
            consumer_index=consumer_index if options.coordinated else None, source=source,
            inherited=not blob and self.served.pipeline is None, resume=resume)
        self.items: queue.Queue[Item] = queue.Queue()  # to the iterating thread
        self.stats = Stats(width=max(1, options.num_workers))
        self.failure: BaseException | None = None  # what stopped the thread, if anything
        put = self.items.put
        self._session = Session(consumer=register.consumer)
        self._rounds = Rounds(coordinated) if coordinated else None
        self._link = BrokerLink(self.settings, self._session, self.stats, register, blob,
                                self._rounds, put)
        self._peers = Peers(self.settings, self._session, self.stats, self._rounds)
        self._end = EpochEnd(self.settings, self._session, self.stats, self._link,
                             self._peers, self._rounds, put, register.resume)
        self._peers.on_gone = self._end.check
        self._receiver = Receiver(self._session, self.stats, self._peers, self._link,
                                  self._end, self._rounds, put)
        self._rejected_logged = 0.0  # when a dropped message was last logged
        self._commands: deque[tuple[Any, ...]] = deque()
        self._halt = threading.Event()
        # A command wakes the thread at once (a byte in this pipe) instead of at its next poll.
        # The pipe is closed once the thread has stopped (close(), or __del__ if it never
        # ran), so writers need no lock.
        self._unsent: dict[str, int] = {}  # credits given back since the last wake-up
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._broker: zmq.Socket[Any] | None = None
        self._data_server: zmq.Socket[Any] | None = None
        self._guard: Any = None  # the ZAP handler, with keys and a source socket
        self._turn = Turn()  # who steps the loop (see the module's docstring)
        self._poller: zmq.Poller | None = None  # (set once the sockets exist)
        self._next_beat = 0.0

    # --- called from the iterating thread -------------------------------------------------

    def start_epoch(self, epoch: int, epoch_input: list[Any]) -> None:
        """Open ``epoch`` on every worker, with ``epoch_input`` (codec frames)."""
        self._command(("start", epoch, epoch_input))

    def credit(self, worker: str, credits: int = 1) -> None:
        """Give ``worker`` back the credits of ``credits`` records used. The thread is woken
        only once a CREDIT is due (half the prefetch, as :meth:`Peers.credit` sends them):
        fewer credits wait for its next poll (POLL_MS), or the next message it handles."""
        self._commands.append(("credit", worker, credits))
        owed = self._unsent.get(worker, 0) + credits
        if owed >= self.settings.credit_batch:
            owed = 0
            if not self._turn.lent():  # (lent: the iterating thread sends it as it steps)
                self._wake()
        self._unsent[worker] = owed

    def take(self, timeout: float) -> Item | None:
        """The next item, or None when none came within ``timeout`` seconds. With none
        waiting, the calling thread borrows the turn and steps the loop itself until one
        comes (see the module's docstring); a failure of the loop there stops the I/O
        thread and comes back as an error item, as it would from the I/O thread."""
        with contextlib.suppress(queue.Empty):
            return self.items.get_nowait()
        deadline = time.monotonic() + timeout
        with self._turn.lent_to_reader(deadline, self._wake) as had:
            stepped = had and self._step_until(deadline)
        return self._get(0.0 if stepped else max(0.0, deadline - time.monotonic()))

    def _step_until(self, deadline: float) -> bool:
        """Step the loop (the turn held) until an item waits or ``deadline`` passes.
        False when it could not: the sockets not made yet or closed, or the loop failed
        (its error item waits)."""
        try:
            while self._poller is not None and not self._halt.is_set():
                self._step(max(0, min(POLL_MS, int((deadline - time.monotonic()) * 1000))))
                if not self.items.empty() or time.monotonic() >= deadline:
                    return True
            return False
        except Exception as exc:  # (KeyboardInterrupt and the like propagate)
            self._failed(exc)
            return False

    def _get(self, timeout: float) -> Item | None:
        try:
            return self.items.get(timeout=timeout) if timeout > 0 else self.items.get_nowait()
        except queue.Empty:
            return None

    @property
    def registration(self) -> dict[str, Any]:
        """The body of this consumer's REGISTER (its ``consumer`` id, ``source_data``)."""
        return messages.encode(self._link.register)

    @property
    def halted(self) -> bool:
        """Whether :meth:`close` was called (or the loop failed)."""
        return self._halt.is_set()

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
        if self._rounds is not None and self._rounds.vacant:
            return (f"no data for {silent:.0f} s: coordinated reads wait for consumer_index "
                    f"{', '.join(map(str, self._rounds.vacant))} of {self._rounds.size} "
                    "to join")
        waiting = [p for p in peers if p.worker not in self._session.ended]
        if waiting:
            quiet = min(waiting, key=lambda p: p.heard)
            why = (f" though it holds {quiet.owed} credits of this consumer: its user code "
                   "may be blocked (a deadlock, a wait that never ends) or its process "
                   "stopped" if quiet.owed > 0 else "")
            return (f"no data from the job's {len(peers)} workers for {silent:.0f} s; "
                    f"{quiet.describe()} has sent nothing for "
                    f"{time.monotonic() - quiet.heard:.0f} s{why} (raise timeout= if one "
                    "element can take longer)")
        return (f"no data from the job's {len(peers)} workers for {silent:.0f} s "
                "(raise timeout= to wait longer)")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (it tells the workers and the broker) and wait for it."""
        self._halt.set()
        self._wake()
        self._turn.stop()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout)
        if not self.is_alive():
            self._close_pipe()  # its fds go now, not when this object is collected
            self._drop_items()

    def _drop_items(self) -> None:
        """Drop the records nobody will read: their elements are views into the rings,
        whose mappings (and descriptors) would otherwise live until this object is
        collected."""
        with contextlib.suppress(queue.Empty):
            while True:
                self.items.get_nowait()

    def _command(self, command: tuple[Any, ...]) -> None:
        self._commands.append(command)
        self._wake()

    def _wake(self) -> None:
        if self._wake_write < 0:
            return  # closed: nobody reads it any more
        with contextlib.suppress(OSError):  # BlockingIOError: a wake-up is pending anyway
            os.write(self._wake_write, b"!")

    def _close_pipe(self) -> None:
        fds = (getattr(self, "_wake_read", -1), getattr(self, "_wake_write", -1))
        self._wake_read = self._wake_write = -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def __del__(self) -> None:
        self._close_pipe()

    # --- the thread -----------------------------------------------------------------------

    def run(self) -> None:
        context = zmq.Context()
        try:
            with self._turn.held():
                poller = zmq.Poller()
                self._broker = self._link.connect(context)
                poller.register(self._broker, zmq.POLLIN)
                poller.register(self._wake_read, zmq.POLLIN)
                self._peers.attach(context, poller)
                if self.served:
                    self._serve_source(context, poller)
                self._poller = poller
            self._loop()
        except BaseException as exc:
            self._failed(exc)
        finally:
            # (an iterating thread in take() sees the halt at its next step and leaves)
            with self._turn.held():
                self._poller = None
                self._shutdown(context)

    def _failed(self, exc: BaseException) -> None:
        """The loop failed (a bug): stop, and hand the iterating thread the error."""
        self.failure = exc
        log.error("the Loader's I/O thread failed", exc_info=exc)
        self._halt.set()
        self._wake()
        self.items.put(Item("error", error=exc))

    def _loop(self) -> None:
        """Step the loop whenever the iterating thread does not (see the docstring)."""
        while not self._halt.is_set():
            if not self._turn.take_for_io():
                continue
            try:
                self._step(POLL_MS)
            finally:
                self._turn.release()

    def _step(self, poll_ms: int) -> None:
        """One turn of the loop: heartbeat, commands, one poll of every socket (waiting
        up to ``poll_ms``) and the messages it finds, acks, checks. Holds the turn."""
        assert self._poller is not None
        session, now = self._session, time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + session.heartbeat
            self._link.beat()
            if session.job is not None and self._rounds is not None and not session.done:
                self._link.acks += self._rounds.uncommitted()  # in case one was lost
        while self._commands:
            self._run_command(self._commands.popleft())
        for sock, _ in self._poller.poll(poll_ms):
            if sock == self._wake_read:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_read, 4096):
                        pass
                continue
            for frames in waiting(sock, 64):  # (a message may close its peer's socket)
                self._receive(sock, frames)
        self._link.send_acks()
        now = time.monotonic()
        self._end.check_stuck(now)
        self._peers.expire(now)

    def _run_command(self, command: tuple[Any, ...]) -> None:
        if command[0] == "start":
            self._start(command[1], command[2])
        elif command[0] == "credit":
            self._peers.credit(command[1], command[2])

    def _start(self, epoch: int, epoch_input: list[Any]) -> None:
        """Begin ``epoch``: tell the broker, open it on every worker."""
        self._session.start(epoch, epoch_input)
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
        and the thread goes on serving the consumer."""
        try:
            if sock is self._broker:
                self._from_broker(decode(frames))
            elif sock is self._data_server:
                self._fetch(frames)
            else:
                msg = decode(frames)
                peer = self._peers.of(sock)
                if peer is not None:
                    self._receiver.message(peer, msg)
        except ProtocolError as exc:
            self._reject(f"dropped a malformed message: {exc}")
        except Exception:  # a bug must not stop the consumer: log it, drop the message
            self._reject("failed on a message; dropped it", exc_info=True)

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
        self._end.pending = view.pending
        known = self._peers.workers()
        self._peers.update(view.workers)
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
                    self._peers.open(peer)
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

    def _shutdown(self, context: zmq.Context[Any]) -> None:
        if self._data_server is not None:
            self._data_server.close(0)
        self._peers.close_all()
        self._link.bye()
        if self._guard is not None:
            self._guard.stop()
        context.term()
