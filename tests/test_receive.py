"""The consumer's receiving side (client/receive.py ``Receiver``) through its seam
(tests/fakes.py): a record becomes an item, an old epoch's is dropped, an END ends a
worker's part, a record that cannot be read gives its credit back, a record noticed before
the DATA messages its worker sent ahead of it waits for them. Plain calls, no sockets."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fakes import FakeEnd, FakeLink, FakePeers, Frame
from zloader import codec
from zloader.client.items import Data, End
from zloader.client.peers import Peer
from zloader.client.receive import Receiver
from zloader.client.session import EpochInput, Session
from zloader.client.stats import Stats
from zloader.transport import messages
from zloader.transport.notice import Notices
from zloader.transport.protocol import Command, Message, ProtocolError
from zloader.transport.ring import RingReader
from zloader.worker.outgoing import Head
from zloader.worker.streams import Outlet, Stream


class Consumer:
    """A receiver, its fakes, and the items it puts, for one worker ``w1``."""

    def __init__(self, epoch: int = 0) -> None:
        self.session = Session("c1")
        self.session.start(epoch, EpochInput())
        self.stats, self.peers, self.end = Stats(), FakePeers(), FakeEnd()
        self.items: list[Any] = []
        self.receiver = Receiver(self.session, self.stats, self.peers, FakeLink(),  # type: ignore[arg-type]
                                 self.end, None, self.items.append)  # type: ignore[arg-type]
        self.peer = Peer("w1", "t1", 0, 42, "ipc:///w1", None)  # type: ignore[arg-type]
        self.peer.owed = 10

    def data(self, elements: list[Any], epoch: int = 0, **fields: Any) -> None:
        """A DATA message with the record's frames, from ``w1``."""
        body = messages.encode(messages.Data(epoch=epoch, count=len(elements), **fields))
        frames = [Frame(memoryview(bytes(b))) for b in codec.encode(elements)]
        self.receiver.message(self.peer, Message(Command.DATA, body, frames))

    def end_message(self, epoch: int = 0, **fields: Any) -> None:
        body = messages.encode(messages.End(epoch=epoch, **fields))
        self.receiver.message(self.peer, Message(Command.END, body, []))


def test_a_record_becomes_an_item_and_is_counted():
    consumer = Consumer()
    consumer.data([1, 2, 3])
    (item,) = consumer.items
    assert isinstance(item, Data) and item.elements == [1, 2, 3] and item.worker == "w1"
    assert consumer.stats.records == 1 and consumer.stats.per_worker == {42: 3}
    assert consumer.session.got_from == {"w1": 3} and consumer.peer.owed == 9


def test_a_shared_record_s_place_is_noted_for_a_dead_worker_s_fence():
    """What a trainer had of a worker's elements, by place (DATA.first): a late joiner's
    window records first, then the start made again for it. Records without a place
    (another worker's splits it made again) are counted, not placed."""
    consumer = Consumer()
    for first, count in ((40, 3), (43, 2), (0, 4)):
        consumer.data(list(range(count)), shared=False, first=first)
    assert consumer.session.got_from == {"w1": 9}
    assert consumer.session.places("w1") == [[0, 4], [40, 45]]
    consumer.data([7])  # (no place: another worker's, made again by w1)
    assert consumer.session.places("w1") == [[0, 4], [40, 45]]  # (of what w1 made)
    assert consumer.session.got_from == {"w1": 10}
    consumer.session.start(1, EpochInput())
    assert consumer.session.places("w1") == [] and consumer.session.got_from == {}


def test_an_old_epoch_s_record_is_dropped_without_its_credit():
    consumer = Consumer(epoch=1)
    consumer.data([1], epoch=0)
    assert consumer.items == [] and consumer.peers.credits == [] and consumer.peer.owed == 10


def test_an_end_ends_the_worker_s_part_and_asks_whether_the_epoch_is_over():
    consumer = Consumer()
    consumer.data([1])
    consumer.end_message(skipped=2)
    assert isinstance(consumer.items[-1], End) and consumer.session.ended == {"w1"}
    assert consumer.stats.skipped == 2 and consumer.end.checks == 1


def test_a_record_that_cannot_be_decoded_gives_its_credit_back():
    consumer = Consumer()
    body = messages.encode(messages.Data(epoch=0, count=2))
    with pytest.raises(ProtocolError, match="worker pid 42"):
        consumer.receiver.message(consumer.peer, Message(Command.DATA, body,
                                                         [Frame(memoryview(b"junk"))]))
    assert consumer.items == [] and consumer.peers.credits == [("w1", 1)]


def test_a_noticed_record_waits_for_the_data_messages_sent_before_it():
    consumer = Consumer()
    framed = messages.Data(epoch=0, count=1, after=1)  # one DATA message went before it
    buffers = codec.encode(["late"])
    consumer.peer.deferred.append((0.0, framed, buffers, 64))  # (as Receiver.notice holds it)
    consumer.receiver.release(consumer.peer, everything=False)
    assert consumer.items == []  # the DATA message before it has not come
    consumer.data(["early"])
    assert [item.elements for item in consumer.items] == [["early"], ["late"]]


def test_a_notice_of_a_closed_ring_is_ignored():
    consumer = Consumer()
    consumer.receiver.notice(ring_id=7, length=64, position=0)
    assert consumer.items == [] and consumer.peers.credits == []


def test_what_is_not_a_worker_s_message_is_refused():
    consumer = Consumer()
    with pytest.raises(ProtocolError, match="not a message from a worker"):
        consumer.receiver.message(consumer.peer, Message(Command.CREDIT, {}, []))


def test_a_noticed_record_is_read_from_its_ring():
    """A co-located worker's record, framed in the consumer's ring with a notice on its
    pipe (a real ring and pipe: worker/streams.py ``Outlet``), becomes an item."""
    consumer = Consumer()
    ring, notices = RingReader(1 << 20), Notices()
    stream = Stream(b"c1", "c1", 0)
    try:
        stream.attach(ring.name, 7, notices.name)
        consumer.peers.rings[7] = (consumer.peer, ring)
        Outlet(None, lambda text: None).record(  # type: ignore[arg-type]
            stream, Head(0, 2), codec.encode(["x", "y"]))
        (notice,) = list(notices.read())
        consumer.receiver.notice(*notice)
        (item,) = consumer.items
        assert item.elements == ["x", "y"] and consumer.peer.owed == 9
    finally:
        stream.close()
        notices.close()
        ring.close()


def test_an_end_naming_a_drained_worker_s_task_makes_the_trainer_wait_for_its_part():
    """A shared job's worker that handed its splits on before this trainer opened the
    epoch there ends it naming its task (END.handed): the trainer waits for an END from
    any worker that names it (the one that makes those splits again for it), not for it
    once the epoch is over."""
    consumer = Consumer()
    consumer.end_message(handed="t9")
    assert consumer.session.ended == {"w1"} and consumer.session.awaiting == {"t9": ""}
    consumer.session.done = True
    consumer.end_message(handed="t8")
    assert consumer.session.awaiting == {"t9": ""}


class _Peers:
    """The consumer's workers as the end of its epoch sees them: the taker w2 alone, which
    has ended the epoch here; ``opened``: the (task, epoch) this consumer opened."""

    def __init__(self, opened: set[tuple[str, int]] | None = None) -> None:
        self.opened = opened or set()

    def __iter__(self) -> Any:
        return iter(())

    def __len__(self) -> int:
        return 1

    def workers(self) -> set[str]:
        return {"w2"}

    def awaited(self) -> bool:
        return False

    def opened_on(self, task: str, epoch: int) -> bool:
        return (task, epoch) in self.opened

    def stop_reading(self, worker: str, task: str) -> None:
        return None


def _epoch_end(peers: _Peers) -> tuple[Any, Session, list[Any], list[Any]]:
    """A shared job's consumer's end of epoch 0 (its items, the messages it sends)."""
    from zloader.client.epoch_end import EpochEnd
    from zloader.client.session import Settings

    settings = Settings(address="tcp://127.0.0.1:1", prefetch=2, timeout=30.0,
                        use_rings=False, ring_bytes=None, keys=None, data_bind=None,
                        balanced=False, exactly_once=False, coordinated=None, fixed=False)
    session, stats, sent, items = Session("c1"), Stats(), [], []
    session.start(0, EpochInput())
    session.job, stats.share = "j", {"window_bytes": 1 << 20}
    link = type("Link", (), {"send": lambda self, record: sent.append(record)})()
    end = EpochEnd(settings, session, stats, link, peers, None,  # type: ignore[arg-type]
                   items.append, None)
    return end, session, items, sent


def test_a_trainer_that_never_opened_an_epoch_on_a_drained_task_waits_for_its_taker():
    """The view lists task ``t1`` as drained, its splits of epoch 0 handed to worker w2
    (``JOB.drained``). A trainer that joined after t1 left never opened epoch 0 there:
    it waits for w2's END naming t1 (w2 makes those splits again for it; its OPEN may
    have reached w2 before the handover did, and w2 ended its epoch then: the shared-move
    seed 922 sweep case lost all 164 rows so, in 1-2 of 400 runs under load). One that
    opened epoch 0 on t1 had them from t1 (or was told to wait, END.handed), and an
    epoch t1 handed nothing of waits for nothing."""
    from zloader.client.items import Done
    from zloader.client.link import JobView

    drained = ({"task": "t1", "taker": "w2", "epochs": [0]}, {"task": "t0"})
    view = JobView(False, (), (), {}, {}, 1, None, drained)
    end, session, items, _ = _epoch_end(_Peers())
    end.view(view)
    assert session.awaiting == {"t1": "w2"}
    end.check()
    assert items == []
    session.acked.add("t1")  # (w2's END named it)
    end.check()
    assert [type(item) for item in items] == [Done]
    end, session, items, _ = _epoch_end(_Peers(opened={("t1", 0)}))
    end.view(view)
    end.check()
    assert session.awaiting == {} and [type(item) for item in items] == [Done]
    session.start(1, EpochInput())
    end.start()
    assert session.awaiting == {}
    session.start(0, EpochInput())  # (opened on t1, which said it handed epoch 0 on)
    session.awaiting["t1"] = ""  # (Receiver._end: END.handed, its taker not known)
    end.view(view)
    assert session.awaiting == {"t1": "w2"}  # (no longer waited for once w2 leaves)


def test_a_restarted_broker_s_fence_of_a_dead_worker_replaces_the_one_awaited():
    """A shared job's worker dies; the broker fences it (``f1``), this trainer answers and
    waits for the END of the taker naming ``f1``, then the broker is killed before
    handing the splits on. The restarted broker fences the same worker again (``f2``):
    the trainer waits for ``f2`` alone, which the taker names, and its epoch ends (before,
    it waited for ``f1`` too, which no END would name: the slow test_sharing.py
    test_a_broker_restarted_around_a_dead_worker_s_fence_is_exact[1.5] timed out in
    about a third of its runs)."""
    from zloader.client.items import Done

    end, session, items, sent = _epoch_end(_Peers())
    for token in ("f1", "f2"):
        end.answer_fences([{"id": token, "worker": "w1", "task": "t1", "taker": "w2",
                            "splits": [[[0], 3]], "waiting": ["c1"]}])
    assert [record.fence for record in sent] == ["f1", "f2"]
    assert session.awaiting == {"f2": "w2"}
    end.check()
    assert items == []  # (the taker's END naming f2 has not come)
    session.acked.add("f2")
    end.check()
    assert [type(item) for item in items] == [Done]
