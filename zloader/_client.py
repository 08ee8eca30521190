"""The Loader's I/O thread: all of a consumer's sockets, rings and protocol state.

It talks to the broker (register, heartbeats, the job's worker list) and to every worker
(open an epoch, credits, records), decodes records and puts :class:`Item` s on a queue for
the iterating thread. Only this thread touches its sockets; the iterating thread sends it
commands through a deque.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from zloader import codec
from zloader._host import host_id
from zloader.errors import CodecError, PipelineError, Timeout, ZloaderError
from zloader.forward import emit, valid_lines
from zloader.lineage import Ledger, decode_origins
from zloader.shipping import Served
from zloader.transport import records
from zloader.transport.keys import Keys
from zloader.transport.protocol import (
    Command,
    Message,
    ProtocolError,
    decode,
    doing,
    doing_text,
    encode,
    error_from_object,
    heartbeat,
)
from zloader.transport.ring import RingError
from zloader.transport.shm import sweep

__all__ = ["IOThread", "Item", "Origins"]

log = logging.getLogger("zloader.loader")

HEARTBEAT = 1.0
POLL_MS = 5
VACANT_WARNING = 10.0
"""Seconds a coordinated consumer waits for a missing one before it says so (then again)."""
BYE_LINGER_MS = 200
"""At most how long closing waits for the BYE to reach the broker (milliseconds)."""
RING_MAX_BYTES = 1 << 30
"""A ring that keeps filling up with large records grows, by doubling, up to this size."""
REREADS = 3
"""Times an exactly-once epoch that ended short asks for a split again before it raises."""


@dataclass
class Item:
    """What the I/O thread hands the iterating thread."""

    kind: str  # "data", "end" (one worker finished the epoch), "done" (all did), "error"
    epoch: int = -1
    worker: str = ""
    index: int = 0
    elements: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    # Exactly-once jobs: the pass keys by pass id, the origin triples per element (loose
    # ones first: ``counts[0]``) and the rows, and the split ends, see zloader/lineage.py.
    origins: Origins | None = None


@dataclass
class Origins:
    """The origins one record (or an epoch's END) carries."""

    keys: list[tuple[int, ...]]
    counts: Any  # int32: loose, then one per element
    rows: Any  # int64 (n, 3): (pass id, split, index)
    ends: list[tuple[tuple[int, ...], int, int, int]]

    def note(self, ledger: Ledger, elements: int | None = None) -> None:
        """Add the loose origins and those of the first ``elements`` elements (all when
        None), and the split ends, to ``ledger``."""
        rows = self.rows
        if elements is not None:
            rows = rows[:int(self.counts[:elements + 1].sum())]
        ledger.add(self.keys, rows)
        for key, split, count, crc in self.ends:
            ledger.end(key, split, count, crc)


@dataclass
class _Peer:
    worker: str
    task: str | None
    index: int
    pid: int
    endpoint: str
    socket: zmq.Socket[Any]
    ring: Any = None
    returned: int = 0
    mapped: list[str] = field(default_factory=list)  # one-record segments to let go of
    old_rings: list[Any] = field(default_factory=list)  # rings being replaced by a larger one
    host: str = ""
    heard: float = 0.0  # when it last sent something, or was last given credits it lacked
    owed: int = 0  # credits granted for this epoch and not yet used by a record
    reported: float = float("-inf")  # when it was last reported stuck
    doing: dict[str, Any] | None = None  # {epoch, split, stage}, from the job's view

    def describe(self) -> str:
        """``worker pid P on HOST (stage S of split N, epoch E)``, as far as known."""
        text = f"worker pid {self.pid} on {self.host or self.endpoint}"
        if self.doing is not None:
            text += f" ({doing_text(self.doing)})"
        return text


class IOThread(threading.Thread):
    def __init__(self, address: str, blob: bytes, *, fingerprint: str, job_name: str | None,
                 sharding: str, deterministic: bool, num_workers: int, on_error: str,
                 source: dict[str, Any], prefetch: int, use_rings: bool,
                 ring_bytes: int | None, served: Served | None = None,
                 data_bind: str | None = None, balanced: int = 0,
                 share: dict[str, Any] | None = None,
                 coordinated: tuple[int, int] | None = None, keys: Keys | None = None,
                 exactly_once: bool = False, resume: dict[str, Any] | None = None,
                 timeout: float = 60.0, weight: float = 1.0) -> None:
        """``blob`` is the pickled pipeline sent with REGISTER; empty when ``served`` holds
        it (too large for the broker: workers fetch it from this thread's source socket)
        or when the workers inherited it (embedded, fork)."""
        super().__init__(name="zloader-loader-io", daemon=True)
        self.address = address
        self.timeout = timeout  # the Loader's: a worker silent this long with credits is stuck
        self._balanced = balanced > 0
        self._stuck: list[dict[str, Any]] = []  # reports for the broker's next heartbeat
        self._lost: str | None = None  # the last worker taken off the job, described
        self._busy_elsewhere = 0  # the broker's workers serving other jobs (JOB view)
        # Exactly-once: the splits the broker handed out in the epoch (its answer to EPOCH),
        # the job's consumer count, and the splits asked for again this epoch.
        self._read: list[Any] | None = None
        self._consumers = 1
        self._rereads: dict[tuple[tuple[int, ...], int], int] = {}
        self._reread: list[Any] = []  # for the broker's next heartbeat
        self._confirm_asked = 0.0  # when this consumer last sent EPOCH to confirm its epoch's end
        self._short_failed = False  # the epoch ended short for good (raised once)
        self.blob = blob
        self.served = served or Served()
        self.register_body = {
            "consumer": secrets.token_hex(8), "fingerprint": fingerprint, "job_name": job_name,
            "sharding": sharding, "deterministic": deterministic, "num_workers": num_workers,
            "on_error": on_error, "source": source, "host_id": host_id(), "pid": os.getpid(),
            "balanced": balanced, "share": share,
            "coordinated": ({"size": coordinated[0], "index": coordinated[1]}
                            if coordinated else None),
            "exactly_once": exactly_once, "weight": weight}
        if not blob and self.served.pipeline is None:
            self.register_body["pipeline"] = {"inherited": True}
        if resume is not None:
            self.register_body["resume"] = {"epoch": resume["epoch"],
                                            "delivered": resume["delivered"]}
            self.register_body["entropy"] = resume["entropy"]
        self.data_bind = data_bind
        self.keys = keys
        self.prefetch = prefetch
        self.use_rings = use_rings
        self.ring_bytes = ring_bytes
        self.items: queue.Queue[Item] = queue.Queue()
        self.failure: BaseException | None = None
        self.last_progress = time.monotonic()
        self.bytes = 0
        self.records = 0
        self.private = 0
        self.segments = 0
        self.skipped = 0
        self.per_worker: dict[int, int] = {}
        self.lagged = 0  # a shared job's elements this trainer lost to the lag policy
        self.replayed = 0  # ... and the elements made again for it (it joined late)
        self.dropped = 0  # elements dropped to keep rounds whole (coordinated reads)
        self.rejected = 0  # corrupt records and malformed messages dropped (logged)
        self._rejected_logged = 0.0  # when one was last logged (at most once a second)
        self.was_doing: dict[int, str] = {}  # pid -> what a worker that left the job did
        self.yielded = 0  # elements and seconds of waiting, kept by the iterating thread
        self.wait_seconds = 0.0  # (the Loader's stats), sent to the broker for its metrics
        self._acks: list[int] = []  # rounds received, to tell the broker
        self._draining = False  # the epoch has ended but for rounds not yet released
        self.share: dict[str, Any] | None = None  # the shared job's window settings
        self.job_epoch: int | None = None  # the job's current epoch, when it was joined
        self._lagged_by: dict[str, int] = {}
        self._commands: deque[tuple[Any, ...]] = deque()
        self._halt = threading.Event()
        # A command wakes the thread at once (a byte in this pipe) instead of at its next poll.
        # The pipe is closed once the thread has stopped (close(), or __del__ if it never
        # ran), so writers need no lock.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._peers: dict[str, _Peer] = {}
        self._index_of: dict[str, int] = {}
        self._job: str | None = None
        self._epoch: int | None = None
        self._epoch_input: tuple[Any, ...] | list[Any] = ()  # codec frames sent with OPEN
        self._ended: set[str] = set()
        self._done = False
        self._skipped_by: dict[str, int] = {}
        self._reported_failures = 0
        self._reported_error = False
        self._pending: dict[str, Any] = {}
        self._confirming = False  # asked the broker whether the epoch's splits are all done
        self._rerun = 0
        self._fencing: dict[str, Any] = {}
        self._heartbeat = HEARTBEAT  # the broker's, once it has told us
        self._width = max(1, num_workers)
        self._fixed = sharding in ("static", "off")  # every worker index must end the epoch
        self.rounds = _Rounds(coordinated) if coordinated else None
        self.received = Ledger()  # the origins of this epoch received (exactly-once jobs)
        self._answered: dict[str, float] = {}  # fences this consumer answered -> when
        self.entropy: int | None = None  # the job's, once it is known
        self.stages: dict[str, float] = {}  # the job's workers' seconds by stage (broker's)

    # --- called from the iterating thread -------------------------------------------------

    def command(self, command: tuple[Any, ...]) -> None:
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

    def indices(self) -> list[int]:
        return [peer.index for peer in list(self._peers.values())]

    @property
    def width(self) -> int:
        return self._width

    def stall_reason(self, silent: float) -> str:
        if self._job is None:
            keys = ("; with keys, are they the broker's?" if self.keys is not None else
                    "; does it want keys (keys= or ZLOADER_KEYS)?")
            return (f"no broker answered at {self.address} for {silent:.0f} s: is "
                    f"zloader-broker running there{keys} (raise timeout= to wait longer)")
        if not self._peers and self._busy_elsewhere and not self._lost:
            return (f"no worker has served this job for {silent:.0f} s: the broker's "
                    f"{self._busy_elsewhere} workers all run other jobs (a worker serves one "
                    "job at a time): start more workers (zloader-worker --broker "
                    f"{self.address}), pass num_workers=, or close the other Loaders first")
        if not self._peers:
            last = (f"; the last one, {self._lost}, was taken off the job"
                    if self._lost else "; every worker may have died")
            return (f"no worker has served this job for {silent:.0f} s: start workers "
                    f"(zloader-worker --broker {self.address}) or pass num_workers={last} "
                    "(raise timeout= to wait longer)")
        if self.rounds is not None and self.rounds.vacant:
            return (f"no data for {silent:.0f} s: coordinated reads wait for consumer_index "
                    f"{', '.join(map(str, self.rounds.vacant))} of {self.rounds.size} to join")
        waiting = [p for p in self._peers.values() if p.worker not in self._ended]
        if waiting:
            quiet = min(waiting, key=lambda p: p.heard)
            why = (f" though it holds {quiet.owed} credits of this consumer: its user code "
                   "may be blocked (a deadlock, a wait that never ends) or its process "
                   "stopped" if quiet.owed > 0 else "")
            return (f"no data from the job's {len(self._peers)} workers for {silent:.0f} s; "
                    f"{quiet.describe()} has sent nothing for "
                    f"{time.monotonic() - quiet.heard:.0f} s{why} (raise timeout= if one "
                    "element can take longer)")
        return (f"no data from the job's {len(self._peers)} workers for {silent:.0f} s "
                "(raise timeout= to wait longer)")

    def close(self, timeout: float = 5.0) -> None:
        self._halt.set()
        self._wake()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout)
        if not self.is_alive():
            self._close_pipe()  # its fds go now, not when this object is collected

    # --- the thread -----------------------------------------------------------------------

    def run(self) -> None:
        self.context = zmq.Context()
        self.poller = zmq.Poller()
        self.broker = self.context.socket(zmq.DEALER)
        self.broker.setsockopt(zmq.LINGER, 0)
        self.guard: Any = None  # the ZAP handler, with keys and a source socket
        if self.keys is not None:
            self.keys.connect(self.broker)
        self.broker.connect(self.address)
        self.poller.register(self.broker, zmq.POLLIN)
        self.poller.register(self._wake_read, zmq.POLLIN)
        self.data_server: zmq.Socket[Any] | None = None
        try:
            if self.served:
                self._serve_source()
            self._loop()
        except BaseException as exc:
            self.failure = exc
            log.exception("the Loader's I/O thread failed")
            self.items.put(Item("error", error=exc))
        finally:
            self._shutdown()

    def _loop(self) -> None:
        next_beat = 0.0
        while not self._halt.is_set():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self._heartbeat
                if self._job is None:
                    self._to_broker(Command.REGISTER, self.register_body, (self.blob,))
                else:
                    self._heartbeat_broker()
                    if self.rounds is not None and not self._done:
                        self._acks += self.rounds.uncommitted()  # in case a message was lost
            while self._commands:
                self._run_command(self._commands.popleft())
            for sock, _ in self.poller.poll(POLL_MS):
                if sock == self._wake_read:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_read, 4096):
                            pass
                    continue
                for _ in range(64):
                    if sock.closed:  # a message handled just before closed it (a worker
                        break        # that left the job's view)
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._receive(sock, frames)
            if self._acks:
                self._to_broker(Command.RECEIVED, {"epoch": self._epoch, "rounds": self._acks})
                self._acks = []
            self._check_stuck(time.monotonic())

    def _heartbeat_broker(self) -> None:
        body: dict[str, Any] = {"stats": {
            "elements": self.yielded, "bytes": self.bytes,
            "wait_seconds": round(self.wait_seconds, 3), "skipped": self.skipped,
            # reading an epoch not yet ended: the broker's pool counts this job as active
            "active": int(self._epoch is not None and not self._done)}}
        if self._stuck:
            body["stuck"], self._stuck = self._stuck, []
        if self._reread:
            body["reread"], self._reread = self._reread, []
        self._to_broker(Command.HEARTBEAT, body)

    def _check_stuck(self, now: float) -> None:
        """A worker that has sent nothing for ``timeout`` seconds though it holds credits
        of this consumer's epoch is stuck (user code blocked on its producer thread while
        its main loop heartbeats, or the process stopped): tell the broker at once, which
        takes it off the job so that its splits go to the other workers. With no other
        worker to take them, the epoch cannot finish: raise :class:`Timeout` naming it.
        Jobs whose workers may rightly hold back for another consumer (shared, balanced,
        coordinated) are bounded by the Loader's overall timeout only."""
        if self._done or self._epoch is None or self._job is None or self._balanced \
                or self.share is not None or self.rounds is not None:
            return
        for peer in list(self._peers.values()):
            silent = now - peer.heard
            if peer.worker in self._ended or peer.owed <= 0 or silent <= self.timeout \
                    or now - peer.reported <= self.timeout or peer.task is None:
                continue
            peer.reported = now  # once per timeout
            self._stuck.append({"worker": peer.worker, "task": peer.task,
                                "seconds": round(silent, 3)})
            self._heartbeat_broker()
            about = (f"{peer.describe()} sent nothing for {silent:.0f} s though it held "
                     f"{peer.owed} credits of this consumer")
            self._lost = about
            if any(p is not peer for p in self._peers.values()):
                log.warning("%s: its user code may be blocked; the broker takes it off the "
                            "job and the other workers read its splits", about)
                self.last_progress = now  # the rerun gets a full timeout of its own
                continue
            self.items.put(Item("error", error=Timeout(
                f"{about}: its user code may be blocked (a deadlock, a wait that never "
                "ends) and no other worker serves this job to read its splits; the broker "
                "takes it off the job (raise timeout= if one element can take longer)")))

    def _receive(self, sock: zmq.Socket[Any], frames: list[zmq.Frame]) -> None:
        """Decode and handle one message from outside: whatever is wrong with it (malformed,
        hostile, or a bug its handling hits) drops it, counted in ``rejected`` and logged,
        and the thread goes on serving the consumer."""
        try:
            if sock is self.broker:
                self._from_broker(decode(frames))
            elif sock is self.data_server:
                self._fetch(frames)
            else:
                self._from_worker(sock, decode(frames))
        except ProtocolError as exc:
            self._reject(f"dropped a malformed message: {exc}")
        except Exception:  # a bug must not stop the consumer: log it, drop the message
            self._reject("failed on a message; dropped it", exc_info=True)

    def _reject(self, text: str, exc_info: bool = False) -> None:
        """Count a dropped message; log it at most once a second (a flood of junk must
        not flood the trainer's log)."""
        self.rejected += 1
        now = time.monotonic()
        if now - self._rejected_logged >= 1.0:
            self._rejected_logged = now
            log.warning("%s (%d rejected so far)", text, self.rejected, exc_info=exc_info)

    def _serve_source(self) -> None:
        """Bind the socket from which workers fetch this job's in-memory source data and
        its pipeline, when that is too large to pass through the broker."""
        server = self.context.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            self.guard = self.keys.guard(self.context)
            self.keys.serve(server)
        server.bind(self.data_bind or f"tcp://{_local_address(self.address)}:*")
        self.data_server = server
        self.poller.register(server, zmq.POLLIN)
        self.register_body.update(
            self.served.fields(server.getsockopt_string(zmq.LAST_ENDPOINT)))

    def _fetch(self, frames: list[zmq.Frame]) -> None:
        assert self.data_server is not None
        reply = self.served.answer(decode(frames[1:]))
        self.data_server.send_multipart([frames[0].bytes, *reply], copy=False)

    def _shutdown(self) -> None:
        if self.data_server is not None:
            self.data_server.close(0)
        for peer in list(self._peers.values()):
            self._close_peer(peer, polite=True)
        with contextlib.suppress(zmq.ZMQError):
            self._to_broker(Command.BYE, {})
        # A moment for the BYE to leave: the broker then releases the job at once, where a
        # lost one costs the next job on its name or its workers an expiry's wait.
        self.broker.close(linger=BYE_LINGER_MS)
        if self.guard is not None:
            self.guard.stop()
        self.context.term()

    def _to_broker(self, command: Command, body: dict[str, Any],
                   payload: tuple[Any, ...] = ()) -> None:
        with contextlib.suppress(zmq.Again):  # not connected yet: the next beat tries again
            self.broker.send_multipart(encode(command, body, payload), zmq.NOBLOCK)

    def _run_command(self, command: tuple[Any, ...]) -> None:
        if command[0] == "start":
            self._epoch = command[1]
            self._epoch_input = command[2] if len(command) > 2 else ()
            self._ended = set()
            self._done = False
            self._confirming = False
            self._rerun = 0
            self._skipped_by = {}
            self._draining = False
            self.received = Ledger()
            resume = self.register_body.get("resume")
            if isinstance(resume, dict) and resume["epoch"] == self._epoch:
                self.received.merge_json(resume["delivered"])  # held before the restart
            self._read, self._rereads, self._short_failed = None, {}, False
            self.last_progress = time.monotonic()  # the timeout counts from the start
            if self.rounds is not None:
                self.rounds.start(self._epoch)
                self.rounds.ends.clear()
            if self._job is not None:
                self._to_broker(Command.EPOCH, {"job": self._job, "epoch": self._epoch})
            for peer in self._peers.values():
                self._open(peer)
        elif command[0] == "credit":
            target = self._peers.get(command[1])
            if target is not None and self._epoch is not None:
                target.returned += command[2]
                if target.returned >= max(1, self.prefetch // 2) or target.mapped:
                    if target.owed <= 0:  # it had none: its silence so far says nothing
                        target.heard = time.monotonic()
                    target.owed += target.returned
                    self._send(target, Command.CREDIT, {"epoch": self._epoch,
                                                        "credits": target.returned,
                                                        "mapped": target.mapped})
                    target.returned = 0
                    target.mapped = []

    # --- broker ---------------------------------------------------------------------------

    def _from_broker(self, msg: Message) -> None:
        if msg.command is Command.JOB:
            registered = self._job is None
            if registered:
                self.last_progress = time.monotonic()
                share, epoch = msg.body.get("share"), msg.body.get("epoch")
                self.share = share if isinstance(share, dict) else None
                self.job_epoch = epoch if isinstance(epoch, int) else 0
                if self.rounds is not None:
                    self.rounds.joined(msg.body.get("joined"), self._epoch)
            if self.rounds is not None:
                self.rounds.view(msg.body.get("rounds"), self.address)
            self._job = msg.field("job", str)
            width = msg.body.get("width")
            if isinstance(width, int) and width > 0:
                self._width = width
            beat = heartbeat(msg.body.get("heartbeat"))
            if beat is not None:
                self._heartbeat = beat
            job_error = msg.body.get("error")
            if job_error and not self._reported_error:
                self._reported_error = True
                self.items.put(Item("error", error=error_from_object(job_error,
                                                                      "worker start-up")))
            failed = msg.field("failed", list)
            if len(failed) > self._reported_failures:  # before any "done" this JOB causes
                entry = failed[-1] if isinstance(failed[-1], dict) else {}
                self._reported_failures = len(failed)
                self.items.put(Item("error", error=PipelineError.create(
                    "worker", "RuntimeError", str(entry.get("message", "a split failed")),
                    context=f"split {entry.get('split')}", builtin="RuntimeError")))
            pending = msg.body.get("pending")
            self._pending = pending if isinstance(pending, dict) else {}
            entropy = msg.body.get("entropy")
            if isinstance(entropy, int):
                self.entropy = entropy
            stages = msg.body.get("stages")
            if isinstance(stages, dict):
                self.stages = {str(k): float(v) for k, v in stages.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)}
            known = set(self._peers)
            self._update_workers(msg.field("workers", list))
            self._answer_fences(msg.body.get("fences"))
            fencing = msg.body.get("fencing")
            self._fencing = fencing if isinstance(fencing, dict) else {}
            consumers = msg.body.get("consumers")
            if isinstance(consumers, int):
                self._consumers = consumers
            busy = msg.body.get("busy_elsewhere")
            self._busy_elsewhere = busy if isinstance(busy, int) and busy >= 0 else 0
            # An exactly-once epoch is confirmed only by the answer to EPOCH, which says
            # what was read in it (the epoch is checked against that).
            confirmed = self._confirming
            if isinstance(msg.body.get("read"), list):
                self._read = msg.body["read"]
            elif self.register_body["exactly_once"]:
                confirmed = False
            if registered and self._epoch is not None and not self._done:
                # Registered again mid-epoch (the broker had given up on this consumer, or
                # restarted): the workers dropped its streams, so open the epoch again.
                for worker in known & set(self._peers):
                    self._open(self._peers[worker])
            self._check_done(confirmed=confirmed)
            # The broker's traffic is no progress: only data is (a stuck worker heartbeats).
        elif msg.command is Command.ERROR:
            text = str(msg.body.get("message", "the broker refused the request"))
            error: Exception = ValueError(text) if "job_name" in text else ZloaderError(text)
            self.items.put(Item("error", error=error))
        elif msg.command is Command.LOG:
            lines = valid_lines(msg.body.get("lines"))
            host, pid = msg.body.get("host"), msg.body.get("pid")
            if lines is not None and isinstance(host, str) and isinstance(pid, int):
                emit(host[:255], pid, lines)
        elif msg.command is Command.COMMIT:
            if self.rounds is not None:
                self.rounds.total_lost = int(msg.body.get("total_lost") or 0)
                if msg.field("epoch", int) == self._epoch:
                    self.rounds.commit(msg.field("rounds", list), msg.field("lost", list))
                    self._release_rounds()
        elif msg.command is Command.UNKNOWN:
            if self._job is not None:  # the broker restarted: register again on the next
                self.register_body["job"] = self._job  # beat, for the same job if it has it
            self._job = None

    def _answer_fences(self, fences: Any) -> None:
        """A worker of an exactly-once job died: this consumer reads nothing more from it
        (it left the job's view, so its peer is closed) and tells the broker which elements
        of its splits it holds; the broker hands the splits out again less those. It
        answers again, once a heartbeat, while the fence still lists it as ``waiting``
        (its answer was lost: the broker had dropped it, or stalled)."""
        if not isinstance(fences, list):
            return
        now = time.monotonic()
        for fence in fences:
            if not (isinstance(fence, dict) and isinstance(fence.get("id"), str)
                    and isinstance(fence.get("splits"), list)) \
                    or not self._asked(fence, now) \
                    or any(p.worker == fence.get("worker") and p.task == fence.get("task")
                           for p in self._peers.values()):
                continue
            self._answered[fence["id"]] = now
            splits = []
            for entry in fence["splits"]:
                if not (isinstance(entry, list) and len(entry) == 2
                        and isinstance(entry[0], list) and entry[0]
                        and isinstance(entry[1], int)):
                    continue
                key, split = tuple(entry[0]), entry[1]
                if self._epoch is None or key[0] > self._epoch:
                    info: dict[str, Any] = {"have": ""}
                elif key[0] < self._epoch or self._done:
                    info = {"all": True}  # an epoch this consumer has finished
                else:
                    info = self.received.info(key, split)
                splits.append([list(key), split, info])
            self._to_broker(Command.DELIVERED, {"job": self._job, "fence": fence["id"],
                                                "splits": splits})

    def _asked(self, fence: dict[str, Any], now: float) -> bool:
        """Whether to answer ``fence``: never answered, or still ``waiting`` for this
        consumer a heartbeat after its last answer."""
        answered = self._answered.get(fence["id"])
        if answered is None:
            return True
        waiting = fence.get("waiting")
        return (isinstance(waiting, list) and self.register_body["consumer"] in waiting
                and now - answered >= self._heartbeat)

    def _update_workers(self, workers: list[Any]) -> None:
        seen = set()
        for entry in workers:
            if not isinstance(entry, dict) or not isinstance(entry.get("worker"), str):
                continue
            worker = entry["worker"]
            peer = self._peers.get(worker)
            if peer is not None:
                peer.doing = doing(entry.get("doing"))
            if peer is not None and entry.get("task") != peer.task:
                # The broker dropped this worker and gave it a task again: the old stream
                # is over (what it held was re-queued); read the new task afresh.
                self._close_peer(peer, polite=False)
                peer = None
            seen.add(worker)
            if peer is None:
                self._connect(entry)
        gone = [w for w in self._peers if w not in seen]
        for worker in gone:
            if worker not in self._ended:
                self._lost = self._peers[worker].describe() + " stopped answering"
            self._close_peer(self._peers[worker], polite=False)
            self._check_done()
        if gone:
            sweep()  # a worker that died cannot unlink its segments: remove them for it

    def _connect(self, entry: dict[str, Any]) -> None:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.keys is not None and entry.get("plain_data") is True:
            self.keys.connect_plain(sock)  # the worker's --plain-data
        elif self.keys is not None:
            self.keys.connect(sock)
        try:
            sock.connect(str(entry["endpoint"]))
        except zmq.ZMQError as exc:
            sock.close(0)
            log.warning("cannot connect to worker %s at %r: %s", entry["worker"],
                        entry["endpoint"], exc)
            return
        task = entry.get("task") if isinstance(entry.get("task"), str) else None
        peer = _Peer(entry["worker"], task, int(entry.get("index", 0)),
                     int(entry.get("pid", 0)), str(entry["endpoint"]), sock,
                     host=str(entry.get("host", ""))[:255], heard=time.monotonic(),
                     doing=doing(entry.get("doing")))
        if self.use_rings and entry.get("host_id") == host_id():
            peer.ring = _make_ring(self.ring_bytes)
        self._peers[peer.worker] = peer
        self._index_of[peer.worker] = peer.index
        self.poller.register(sock, zmq.POLLIN)
        if self._epoch is not None and not self._done:
            self._open(peer)

    def _close_peer(self, peer: _Peer, polite: bool) -> None:
        if polite:
            self._send(peer, Command.CLOSE, {})
        self.poller.unregister(peer.socket)
        peer.socket.close(0)
        for ring in [peer.ring, *peer.old_rings]:
            if ring is not None:
                ring.close()  # unlinks now; views the user holds stay valid
        peer.old_rings.clear()
        self._peers.pop(peer.worker, None)
        if peer.doing is not None:  # what it last did, should it turn out to have died
            self.was_doing[peer.pid] = doing_text(peer.doing)

    # --- workers --------------------------------------------------------------------------

    def _open(self, peer: _Peer, keep_credits: bool = False) -> None:
        if not keep_credits:
            peer.returned = 0
        peer.owed, peer.heard = self.prefetch, time.monotonic()  # OPEN grants afresh
        body = {"job": self._job, "task": peer.task, "consumer": self.register_body["consumer"],
                "epoch": self._epoch, "credits": self.prefetch, "rerun": self._rerun,
                "ring": peer.ring.name if peer.ring is not None else None}
        if self.rounds is not None:
            body["consumer_index"] = self.rounds.index
        self._send(peer, Command.OPEN, payload=self._epoch_input, body=body)

    def _send(self, peer: _Peer, command: Command, body: dict[str, Any],
              payload: tuple[Any, ...] | list[Any] = ()) -> None:
        try:
            peer.socket.send_multipart(encode(command, body, payload), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("worker %s is not reachable: %s not sent", peer.endpoint, command.name)

    def _from_worker(self, sock: zmq.Socket[Any], msg: Message) -> None:
        peer = next((p for p in self._peers.values() if p.socket is sock), None)
        if peer is None:
            return
        self.last_progress = peer.heard = time.monotonic()
        epoch = msg.body.get("epoch")
        if not isinstance(epoch, int) and msg.command in (Command.DATA, Command.END,
                                                          Command.FAIL):
            raise ProtocolError(f"{msg.command.name} without an epoch")
        if msg.command is Command.DATA:
            if epoch != self._epoch:
                return  # an old epoch's record: its credit is not coming back, by design
            peer.owed -= 1
            try:
                self._data(peer, msg)
            except (ProtocolError, CodecError, RingError) as exc:
                # Dropped (a corrupt record, in shared memory or on the wire), counted by
                # _receive, and its credit given back so that the worker goes on.
                self._run_command(("credit", peer.worker, 1))
                raise ProtocolError(f"DATA from worker pid {peer.pid} at {peer.endpoint}: "
                                    f"{exc}") from None
        elif msg.command is Command.END:
            if epoch == self._epoch:
                self._skipped_by[peer.worker] = int(msg.body.get("skipped", 0))
                self.skipped = sum(self._skipped_by.values())
                dropped = msg.body.get("dropped")
                if isinstance(dropped, int) and not isinstance(dropped, bool):
                    self.dropped += dropped
                rerun = msg.body.get("rerun")
                if self.rounds is not None and isinstance(rerun, int):
                    self.rounds.ends[peer.worker] = max(rerun,
                                                        self.rounds.ends.get(peer.worker, -1))
                self._note_lagged(peer, msg)
                self._ended.add(peer.worker)
                origins = None
                if "origins" in msg.body:
                    loose = msg.body["origins"].get("loose") \
                        if isinstance(msg.body["origins"], dict) else None
                    if not isinstance(loose, list) or len(loose) % 3 \
                            or not all(isinstance(v, int) and v >= 0 for v in loose):
                        raise ProtocolError("END.origins.loose must be a list of triples")
                    triples = np.array(loose, np.int64).tobytes()
                    counts = np.array([len(loose) // 3], np.int32).tobytes()
                    origins = self._origins(msg.body["origins"], [counts, triples], 0)
                    origins.note(self.received)
                self.items.put(Item("end", epoch if isinstance(epoch, int) else -1,
                                    peer.worker, peer.index, origins=origins))
                self._check_done()
        elif msg.command is Command.FAIL:
            if epoch == self._epoch:
                self.items.put(Item("error", error=error_from_object(msg.body.get("error"))))
        elif msg.command is Command.ERROR:
            log.warning("worker %s refused: %s", peer.endpoint, msg.body.get("message"))

    def _data(self, peer: _Peer, msg: Message) -> None:
        count = msg.field("count", int)
        ring = msg.body.get("ring")
        segment = msg.body.get("segment")
        buffers: list[Any]
        if segment is not None:
            block = self._map_segment(peer, segment, private=bool(msg.body.get("shared")))
            buffers = records.unpack(memoryview(block))
            self.segments += 1
        elif ring is not None:
            reader = self._ring_of(peer, ring)
            block = reader.claim(int(ring[0]), int(ring[1]))
            buffers = records.unpack(memoryview(block))
        else:
            buffers = [frame.buffer for frame in msg.payload]
            self.private += peer.ring is not None
        if msg.body.get("full") and peer.ring is not None:
            self._grow_ring(peer, records.packed_size(buffers))
        origins = None
        if "origins" in msg.body:
            if len(buffers) < 3:
                raise ProtocolError("DATA with origins but fewer than 3 buffers")
            origins = self._origins(msg.body["origins"], buffers[-2:], count)
            buffers = buffers[:-2]
        elements = codec.decode(buffers)
        if not isinstance(elements, list) or len(elements) != count:
            raise ProtocolError(f"DATA record holds {type(elements).__name__}, not {count} "
                                "elements")
        self.records += 1
        self.bytes += sum(memoryview(b).nbytes for b in buffers)
        self.per_worker[peer.pid] = self.per_worker.get(peer.pid, 0) + count
        self._note_lagged(peer, msg)
        item = Item("data", self._epoch if self._epoch is not None else -1, peer.worker,
                    peer.index, elements, origins=origins)
        if origins is not None:
            origins.note(self.received)
        if self.rounds is None:
            self._skipped_by[peer.worker] = int(msg.body.get("skipped", 0))
            self.skipped = sum(self._skipped_by.values())
            self.items.put(item)
            return
        number = msg.field("round", int)
        if not self._done and self.rounds.hold(number, item):
            self._acks.append(number)
            self._release_rounds()
        else:  # a round this consumer skipped (lost, or before it joined)
            self._run_command(("credit", peer.worker, 1))

    @staticmethod
    def _origins(head: Any, buffers: list[Any], count: int) -> Origins:
        """The origins of a record of ``count`` elements (``head``: its pass table and split
        ends; ``buffers``: its two origin buffers).

        Raises:
            ProtocolError: they are malformed.
        """
        if not isinstance(head, dict) or not isinstance(head.get("passes"), dict) \
                or not isinstance(head.get("ends"), list):
            raise ProtocolError("origins must be {passes, ends}")
        keys: dict[int, tuple[int, ...]] = {}
        for pass_id, key in head["passes"].items():
            if not (pass_id.isdigit() and int(pass_id) < 1 << 20 and isinstance(key, list)
                    and key and all(isinstance(k, int) and k >= 0 for k in key)):
                raise ProtocolError("origins.passes must map pass ids to pass keys")
            keys[int(pass_id)] = tuple(key)
        try:
            counts, rows = decode_origins(buffers[0], buffers[1], count)
        except ValueError as exc:
            raise ProtocolError(f"DATA: {exc}") from None
        table = [keys.get(i, ()) for i in range(max(keys, default=-1) + 1)]
        if len(rows) and (int(rows[:, 0].max()) >= len(table)
                          or not all(table[i] for i in np.unique(rows[:, 0]).tolist())):
            raise ProtocolError("DATA: an origin names a pass the record does not")
        ends = []
        for end in head["ends"]:
            if not (isinstance(end, list) and len(end) == 4
                    and all(isinstance(v, int) and v >= 0 for v in end) and end[0] in keys):
                raise ProtocolError("origins.ends must be [pass id, split, count, digest]")
            ends.append((keys[end[0]], end[1], end[2], end[3]))
        return Origins(table, counts, rows, ends)

    def _ring_of(self, peer: _Peer, ring: Any) -> Any:
        """The ring a DATA refers to: the current one or, until the worker has switched, a
        ring it is growing out of (records arrive in order, so once one names the current
        ring the older rings get no more)."""
        if not (isinstance(ring, list) and len(ring) == 3 and isinstance(ring[2], str)):
            raise ProtocolError("DATA.ring must be [position, length, ring name]")
        if peer.ring is not None and ring[2] == peer.ring.name:
            for old in peer.old_rings:
                old.close()
            peer.old_rings.clear()
            return peer.ring
        for old in peer.old_rings:
            if old.name == ring[2]:
                return old
        raise ProtocolError(f"DATA names ring {ring[2]!r}, which this consumer did not open")

    def _grow_ring(self, peer: _Peer, record_bytes: int) -> None:
        """The worker found the ring full: when records are large for it (fewer than
        ``prefetch + 1`` fit), replace it with one twice as large, up to RING_MAX_BYTES."""
        assert peer.ring is not None
        capacity = peer.ring.capacity
        if record_bytes * (self.prefetch + 1) <= capacity or capacity >= RING_MAX_BYTES:
            return
        bigger = _make_ring(min(RING_MAX_BYTES, capacity * 2))
        if bigger is None:
            return
        peer.old_rings.append(peer.ring)
        peer.ring = bigger
        self._send(peer, Command.RING, {"ring": bigger.name})

    def _note_lagged(self, peer: _Peer, msg: Message) -> None:
        replayed = msg.body.get("replayed")
        if isinstance(replayed, int) and not isinstance(replayed, bool):
            self.replayed += replayed
        lagged = msg.body.get("lagged")
        if isinstance(lagged, int) and not isinstance(lagged, bool):
            self._lagged_by[peer.worker] = lagged
            self.lagged = sum(self._lagged_by.values())

    def _map_segment(self, peer: _Peer, segment: Any, private: bool = False) -> Any:
        """Map a one-record segment; the worker unlinks it once told (next CREDIT). A
        shared job's record is mapped copy-on-write (``private``): writing into an element
        changes this process's copy only."""
        from zloader.transport.shm import Segment

        if not (isinstance(segment, list) and len(segment) == 2
                and isinstance(segment[0], str) and isinstance(segment[1], int)):
            raise ProtocolError("DATA: segment must be [name, length]")
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

    def _check_done(self, confirmed: bool = False) -> None:
        """End the epoch once every worker ended it. With dynamic sharding the broker must
        also confirm that no split of the epoch waits to be re-run (a dead worker's); if
        some do, the live workers run the epoch again for them (a rerun)."""
        if self._done or self._epoch is None or not self._peers:
            return
        if self._fixed:
            ended = {self._index_of.get(w) for w in self._ended}
            if len(ended - {None}) < self._width:
                return
            if self.rounds is None:
                self._finish()
                return
        elif self.rounds is not None:  # every worker ended the epoch's latest rerun
            if not all(self.rounds.ends.get(w, -1) >= self._rerun for w in self._peers):
                return
        elif not all(worker in self._ended for worker in self._peers):
            return
        if self.share is not None:  # a shared job's epoch is what its workers produced
            self._finish()
            return
        if int(self._fencing.get(str(self._epoch), 0)):
            return  # a dead worker's splits are about to be re-queued: wait for them
        if not confirmed:
            now = time.monotonic()
            # An exactly-once epoch waits for an answer to EPOCH: ask again when the last
            # one came while a fence held the epoch, or was lost.
            if not self._confirming or (self.register_body["exactly_once"]
                                        and now - self._confirm_asked > self._heartbeat):
                self._confirming, self._confirm_asked = True, now
                self._to_broker(Command.EPOCH, {"job": self._job, "epoch": self._epoch})
            return
        self._confirming = False
        pending = int(self._pending.get(str(self._epoch), 0))
        if self.rounds is not None:
            # The broker orders reruns of a coordinated epoch, once for all its consumers:
            # each deciding alone, at another moment, they would read different rounds.
            ordered = int(self.rounds.reruns.get(str(self._epoch), 0))
            if ordered > self._rerun:
                self._rerun = ordered
                for peer in self._peers.values():
                    self._open(peer, keep_credits=True)
                return
            if pending > 0:
                return  # the broker orders a rerun on a confirmation: ask again next beat
            if not self.rounds.finished(self._epoch):
                self._draining = True  # rounds still to commit or to arrive
                return
            self._finish()
            return
        if pending == 0:
            if not self._short():
                self._finish()
            return
        self._rerun += 1  # a dead worker's splits wait: the workers run the epoch again
        self._ended = set()
        for peer in self._peers.values():
            self._open(peer, keep_credits=True)

    def _short(self) -> bool:
        """Whether an exactly-once epoch that every worker ended lacks elements, checked
        against what its records said (each split's count) and what the broker handed out:
        records can be lost on the way (a segment its worker unlinked while this consumer
        was stalled, records another peer took with its token). The job's only consumer
        asks for the splits concerned again, less what it holds (``HEARTBEAT.reread``),
        then for the epoch's state again; after REREADS tries it raises. True: the epoch
        must not end now."""
        if self._short_failed:
            return True
        if not self.register_body["exactly_once"] or self._consumers != 1 \
                or self._epoch is None:
            return False
        missing = self.received.missing(self._epoch, self._read)
        if not missing:
            return False
        where = ", ".join(f"{split} (pass {list(key)})" for key, split in sorted(missing)[:8])
        if any(self._rereads.get(at, 0) >= REREADS for at in missing):
            self._short_failed = True
            self.items.put(Item("error", error=ZloaderError(
                f"epoch {self._epoch} ended short: elements of splits {where} never reached "
                f"this consumer ({len(missing)} splits), and {REREADS} readings again did not "
                "bring them; records are being lost on the way (see the warnings: malformed "
                "DATA, another peer with this consumer's keys reading its stream)")))
            return True
        log.warning("epoch %d ended short of elements of %d splits (%s): reading them "
                    "again", self._epoch, len(missing), where)
        for at in missing:
            self._rereads[at] = self._rereads.get(at, 0) + 1
        self._reread = [[list(key), split, self.received.info(key, split)]
                        for key, split in sorted(missing)]
        self._heartbeat_broker()  # before the EPOCH, which then finds them pending
        self._confirming, self._confirm_asked = True, time.monotonic()
        self._to_broker(Command.EPOCH, {"job": self._job, "epoch": self._epoch})
        return True

    def _release_rounds(self) -> None:
        """Hand the iterating thread every round now in order and committed; drop the
        lost ones (giving their credits back)."""
        assert self.rounds is not None
        for item in self.rounds.release():
            if item.kind == "data":
                self.items.put(item)
            else:
                self._run_command(("credit", item.worker, 1))
        if self._draining and not self._done and self.rounds.finished(self._epoch):
            self._finish()

    def _finish(self) -> None:
        self._done = True
        self.items.put(Item("done", self._epoch if self._epoch is not None else -1))


class _Rounds:
    """A coordinated consumer's rounds (zloader/rounds.py): it yields round k of an epoch
    once it holds its element and the broker has committed k; lost rounds are skipped."""

    def __init__(self, coordinated: tuple[int, int]) -> None:
        self.size, self.index = coordinated
        self.next = 0
        self.held: dict[int, Item] = {}
        self.committed: set[int] = set()
        self.lost: set[int] = set()
        self.issued: dict[str, int] = {}
        self.total_lost = 0  # the job's rounds lost so far (the same for every consumer)
        self.missed = 0  # rounds this consumer missed: it (re)joined after they were read
        self.reruns: dict[str, int] = {}  # epoch -> reruns the broker ordered
        self.ends: dict[str, int] = {}  # worker -> the latest rerun it ended (this epoch)
        self.start_at: tuple[int, int] | None = None  # (epoch, round) where it joined
        self.vacant: list[int] = []
        self._warned = time.monotonic()

    def joined(self, where: Any, epoch: int | None) -> None:
        """Where the broker placed this consumer on (re-)registering; when that is in the
        epoch under way, jump there now (the streams are opened afresh, so the elements
        held from before are dropped, credits and all)."""
        if not (isinstance(where, dict) and isinstance(where.get("round"), int)
                and isinstance(where.get("epoch"), int) and where["round"] > 0):
            return
        self.start_at = (where["epoch"], where["round"])
        log.info("joined coordinated reads as consumer %d of %d at round %d of epoch %d "
                 "(the rounds before it were read without this consumer)", self.index,
                 self.size, where["round"], where["epoch"])
        if epoch != where["epoch"]:
            self.missed += max(0, int(where.get("missed") or 0))
            return
        self.missed += max(0, where["round"] - self.next)
        self.next = max(self.next, where["round"])
        self.held = {n: item for n, item in self.held.items() if n >= self.next}
        self.committed = {n for n in self.committed if n >= self.next}
        self.lost = {n for n in self.lost if n >= self.next}

    def view(self, rounds: Any, address: str) -> None:
        if not isinstance(rounds, dict):
            return
        if isinstance(rounds.get("issued"), dict):
            self.issued = rounds["issued"]
        if isinstance(rounds.get("lost"), int):
            self.total_lost = rounds["lost"]
        if isinstance(rounds.get("reruns"), dict):
            self.reruns = rounds["reruns"]
        vacant = rounds.get("vacant")
        self.vacant = vacant if isinstance(vacant, list) else []
        now = time.monotonic()
        if not self.vacant:
            self._warned = now  # warn after a vacancy has lasted VACANT_WARNING seconds
        elif now - self._warned > VACANT_WARNING:
            self._warned = now
            log.warning("coordinated reads wait for consumer_index %s of %d to join the job "
                        "(broker %s): every round needs all %d consumers",
                        ", ".join(map(str, self.vacant)), self.size, address, self.size)

    def start(self, epoch: int) -> None:
        self.held.clear()
        self.committed.clear()
        self.lost.clear()
        self.next = 0
        if self.start_at is not None and self.start_at[0] == epoch:
            self.next = self.start_at[1]

    def hold(self, number: int, item: Item) -> bool:
        """Keep round ``number``'s element; False when the round is skipped here."""
        if number < self.next or number in self.lost:
            return False
        self.held[number] = item
        return True

    def uncommitted(self) -> list[int]:
        return [n for n in self.held if n not in self.committed]

    def commit(self, numbers: list[Any], lost: list[Any]) -> None:
        self.committed.update(n for n in numbers if isinstance(n, int) and n >= self.next)
        self.lost.update(n for n in lost if isinstance(n, int) and n >= self.next)

    def release(self) -> list[Item]:
        """Items in round order: ``data`` ones to yield, and the elements of lost rounds
        (kind ``lost``) whose credit goes back."""
        out = []
        for number in sorted(n for n in self.held if n in self.lost):
            item = self.held.pop(number)
            out.append(Item("lost", item.epoch, item.worker, item.index))
        while True:
            if self.next in self.lost:
                self.lost.discard(self.next)
            elif self.next in self.committed and self.next in self.held:
                self.committed.discard(self.next)
                out.append(self.held.pop(self.next))
            else:
                return out
            self.next += 1

    def finished(self, epoch: int | None) -> bool:
        """Every round the broker numbered in ``epoch`` was released or lost."""
        return self.next >= int(self.issued.get(str(epoch), 0))


def _local_address(broker: str) -> str:
    """The address of this host's interface that faces the broker (loopback for a local
    broker), so that the broker's workers can reach what this consumer serves."""
    import socket

    host = broker.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1", "*", ""):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))  # no packet is sent: this only picks a route
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _make_ring(size: int | None) -> Any:
    from zloader.transport.ring import DEFAULT_RING_BYTES, RingReader
    from zloader.transport.shm import ShmError

    try:
        return RingReader(size or DEFAULT_RING_BYTES)
    except ShmError as exc:
        log.warning("%s; using the socket for this worker instead", exc)
        return None
