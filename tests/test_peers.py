"""The consumer's view of its workers (zloader/client/peers.py) as the job's view changes:
real ZeroMQ sockets on loopback (a ROUTER stands where the worker's data socket would be)
and real shared-memory rings."""

from __future__ import annotations

import os
import time

import zmq

from zloader._defaults import LEAVE_GRACE_SECONDS
from zloader._host import host_id
from zloader.client.peers import Peers
from zloader.client.session import Session, Settings
from zloader.client.stats import Stats
from zloader.transport.protocol import Command, decode

SHM_DIR = "/dev/shm"


def _peers_of_a_shared_job(context: zmq.Context) -> Peers:
    """A consumer's peers for a job without exactly-once (a shared job's: a worker taken
    off its view is read on until its END or LEAVE_GRACE_SECONDS), an epoch under way."""
    settings = Settings(address="tcp://127.0.0.1:1", prefetch=2, timeout=30.0,
                        use_rings=True, ring_bytes=1 << 16, keys=None, data_bind=None,
                        balanced=False, exactly_once=False, coordinated=None, fixed=False)
    session = Session(consumer="c1", epoch=0)
    peers = Peers(settings, session, Stats(), None)
    peers.attach(context, zmq.Poller())
    return peers


def test_a_worker_that_leaves_twice_within_its_grace_has_both_streams_closed() -> None:
    """A pool moves a worker off a shared job, back, and off again before the first
    stream's grace is over (jobs that come and go): both old streams are read on, and both
    are closed once their grace is over, their rings unlinked. (The second took the
    first's place among the leaving: the first's socket and ring were never closed, and
    its segment stayed in /dev/shm until the Loader was garbage collected: a teardown
    failure of a generated shared-prefix-move case under load.)"""
    context = zmq.Context()
    worker_socket = context.socket(zmq.ROUTER)
    port = worker_socket.bind_to_random_port("tcp://127.0.0.1")
    peers = _peers_of_a_shared_job(context)
    try:
        rings = []
        for task in ("t1", "t2"):  # (the same worker under two tasks: two streams)
            peers.update([{"worker": "w1", "task": task, "index": 0, "pid": os.getpid(),
                           "endpoint": f"tcp://127.0.0.1:{port}", "host_id": host_id()}])
            (peer,) = peers._peers.values()
            assert peer.ring is not None, "a co-located worker gets a ring"
            rings.append(peer.ring.name)
            peers.update([])  # off the view: leaving, read on until its END or the grace
        assert all(os.path.exists(f"{SHM_DIR}/{name}") for name in rings)
        peers.expire(time.monotonic() + LEAVE_GRACE_SECONDS + 1)
        left = [name for name in rings if os.path.exists(f"{SHM_DIR}/{name}")]
        assert not left, f"rings of leaving streams not closed after their grace: {left}"
    finally:
        peers.close_all()
        worker_socket.close(0)
        context.destroy(0)  # (and any socket a failure left open: term would wait on it)


def test_a_worker_that_drained_away_holds_the_epoch_s_end_until_its_end_or_its_grace(
        caplog) -> None:
    """A view drops two workers whose END has not come: ``t1``'s task left the job cleanly
    (``JOB.drained``: it sends its END last, after what it made), ``t2``'s did not (dead,
    or moved at once: its splits go to the others). The epoch's end waits for t1's END
    only (before, it ended with the view, and t1's last records were dropped: a trainer
    of a generated shared-prefix-move case lost 12 batches in about 1% of runs), and for
    no longer than the grace, saying so."""
    context = zmq.Context()
    sockets = [context.socket(zmq.ROUTER) for _ in range(2)]
    ports = [sock.bind_to_random_port("tcp://127.0.0.1") for sock in sockets]
    peers = _peers_of_a_shared_job(context)
    checked: list[bool] = []
    peers.on_gone = lambda: checked.append(peers.awaited())
    try:
        peers.update([{"worker": f"w{i}", "task": f"t{i}", "index": i, "pid": os.getpid(),
                       "endpoint": f"tcp://127.0.0.1:{port}", "host_id": "elsewhere"}
                      for i, port in enumerate(ports, 1)])
        first, second = peers.get("w1"), peers.get("w2")
        assert first is not None and second is not None
        assert peers.opened_on("t1", 0) and not peers.opened_on("t1", 1)  # (epoch 0 runs)
        peers.update([], drained=("t1",))
        assert peers.awaited() and checked == [True, True]
        peers.left(second)
        assert peers.awaited(), "the END of the worker that did not drain does not count"
        peers.left(first)  # (its END came: Receiver._end)
        assert not peers.awaited()
        peers.update([{"worker": "w1", "task": "t3", "index": 1, "pid": os.getpid(),
                       "endpoint": f"tcp://127.0.0.1:{ports[0]}", "host_id": "elsewhere"}])
        peers.update([], drained=("t1", "t3"))
        assert peers.awaited()
        with caplog.at_level("WARNING", logger="zloader.loader"):
            peers.expire(time.monotonic() + LEAVE_GRACE_SECONDS + 1)
        assert not peers.awaited() and checked[-1] is False
        assert "left the job after draining but its END of epoch 0 did not come" \
            in caplog.text
    finally:
        peers.close_all()
        for sock in sockets:
            sock.close(0)
        context.destroy(0)


def _commands(sock: zmq.Socket, seconds: float) -> list[Command]:
    """The commands that come to the ROUTER ``sock`` within ``seconds``."""
    got, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            got.append(decode(sock.recv_multipart()[1:]).command)
    return got


def test_a_worker_read_on_after_it_left_the_view_gets_its_credits_back() -> None:
    """A moved worker sends what it made for this consumer, then its END, on the stream
    read on after the view dropped it; it needs credits for those records as before.
    (They went only to the workers in the view: a worker moved while the consumer had
    spent its credits could send nothing more until the grace was over.)"""
    context = zmq.Context()
    worker_socket = context.socket(zmq.ROUTER)
    port = worker_socket.bind_to_random_port("tcp://127.0.0.1")
    peers = _peers_of_a_shared_job(context)
    try:
        peers.update([{"worker": "w1", "task": "t1", "index": 0, "pid": os.getpid(),
                       "endpoint": f"tcp://127.0.0.1:{port}", "host_id": "elsewhere"}])
        assert Command.OPEN in _commands(worker_socket, 1.0)
        peers.update([], drained=("t1",))
        assert peers.awaited() and peers.get("w1") is None  # (off the view, read on)
        peers.credit("w1", peers.budget.credit_batch)
        assert _commands(worker_socket, 1.0) == [Command.CREDIT]
    finally:
        peers.close_all()
        worker_socket.close(0)
        context.destroy(0)
