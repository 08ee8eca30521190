"""How a task's pipeline reaches a worker (docs/protocol.md, TASK and FETCH): the worker's
side (:class:`Supply`) and the Loader's (:class:`Served`).

Three ways, cheapest first:

- **inherited**: a worker forked by a Loader holds that Loader's pipelines, by fingerprint,
  in the memory it inherited: nothing is pickled, whatever the dataset's size (as torch's
  workers get their dataset on Linux);
- **inline**: a small pickled pipeline travels in the TASK message itself;
- **fetched**: a large one is served by the Loader that registered it; TASK carries its
  endpoint, SHA-256 digest and size, and the worker fetches it (once per host, see
  :mod:`zloader.blobs`).

A large in-memory source (``from_arrays``/``from_items``) is fetched the same way, from the
same Loader socket, unless the pipeline was inherited whole.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import cloudpickle
import zmq

from zloader import codec
from zloader._defaults import FETCH_TIMEOUT, WARM_BYTES, WARM_PIPELINES, WARM_SECONDS
from zloader.blobs import BlobCache, digest_of
from zloader.pipeline import Pipeline
from zloader.sources import ArraysSource, ItemsSource
from zloader.transport import messages
from zloader.transport.keys import Keys
from zloader.transport.protocol import Command, Message, ProtocolError, decode, encode
from zloader.transport.sockets import make_socket

__all__ = ["FETCH_TIMEOUT", "Loading", "Served", "Supply"]


class Served:
    """What a Loader serves to its job's workers from its source socket (``FETCH``): its
    pickled pipeline when too large to pass through the broker, the data of a large
    in-memory source (``(kind, frames)``). The socket is the Loader's I/O thread's.

    ``counts``: the answers given, by what was asked (``Loader.stats()["served"]``).
    """

    def __init__(self, pipeline: bytes | None = None,
                 source: tuple[str, list[Any]] | None = None) -> None:
        self.pipeline = pipeline
        self.source = source
        self.counts: dict[str, int] = {}

    def __bool__(self) -> bool:
        return self.pipeline is not None or self.source is not None

    def fields(self, endpoint: str) -> dict[str, Any]:
        """REGISTER's ``source_data`` and ``pipeline`` for what is served at ``endpoint``."""
        fields: dict[str, Any] = {}
        if self.source is not None:
            fields["source_data"] = {"endpoint": endpoint, "kind": self.source[0]}
        if self.pipeline is not None:
            fields["pipeline"] = {"endpoint": endpoint, "sha256": digest_of(self.pipeline),
                                  "bytes": len(self.pipeline)}
        return fields

    def answer(self, msg: Message) -> list[Any]:
        """The frames of the ``SOURCE`` reply to ``msg``.

        Raises:
            ProtocolError: ``msg`` is not a FETCH of something served here.
        """
        if msg.command is not Command.FETCH:
            raise ProtocolError(f"{msg.command.name} sent to the source-data socket")
        what = messages.Fetch.from_body(msg.body).what
        if what == "pipeline" and self.pipeline is not None:
            kind, payload = "pipeline", [self.pipeline]
        elif what == "source" and self.source is not None:
            kind, payload = self.source
        else:
            raise ProtocolError(f"FETCH of {what!r}, which this Loader does not serve")
        self.counts[what] = self.counts.get(what, 0) + 1
        return encode(Command.SOURCE, {"kind": kind}, payload)


class Supply:
    """Turns a TASK message into the pipeline to run. A pipeline it loaded stays warm,
    by fingerprint, for a job of the same pipeline after its own ended (a trial run again,
    a validation loader made each epoch): at most ``WARM_PIPELINES`` of them, for
    ``WARM_SECONDS`` since last used, and ``WARM_BYTES`` of pickled pipeline in all (a
    stand-in for the memory they hold); :meth:`warm` lists them for the heartbeat.

    Args:
        context: the worker's ZeroMQ context (fetches open a short-lived socket in it).
        keys: the worker's CURVE keys, for fetches from a Loader that has them.
        inherited: pipelines by fingerprint, held since the fork (embedded workers).
        blob_dir: the host's blob directory (see :mod:`zloader.blobs`), or None.
    """

    def __init__(self, context: zmq.Context[Any], keys: Keys | None,
                 inherited: dict[str, Pipeline] | None, blob_dir: str | None) -> None:
        self.context = context
        self.keys = keys
        self.inherited = dict(inherited or {})
        self.blobs = BlobCache(blob_dir)
        self._lock = threading.Lock()  # loads of a task replaced while it loaded overlap
        # fingerprint -> (pipeline, its pickled bytes, when last used), least recent first
        self._warm: collections.OrderedDict[str, tuple[Pipeline, int, float]] = \
            collections.OrderedDict()

    def warm(self) -> list[str]:
        """The fingerprints of the pipelines kept warm, most recently used last."""
        with self._lock:
            self._expire(time.monotonic())
            return list(self._warm)

    def _expire(self, now: float) -> None:
        """Drop the warm pipelines past their time, their number or their bytes (under
        the lock)."""
        warm = self._warm
        for fingerprint, (_, _, used) in list(warm.items()):
            if now - used > WARM_SECONDS:
                del warm[fingerprint]
        while len(warm) > WARM_PIPELINES or sum(size for _, size, _ in warm.values()) \
                > WARM_BYTES:
            warm.popitem(last=False)

    def start(self, task: messages.Task, payload: list[Any],
              wake: Callable[[], None] | None = None) -> Loading:
        """Load ``task``'s pipeline (inline in ``payload``, or as its ``pipeline`` says):
        at once when it was inherited, else on a thread, calling ``wake`` once done."""
        return Loading(self, task, payload, wake)

    def load(self, task: messages.Task, payload: list[Any]) -> Pipeline:
        """The pipeline of ``task``, with its in-memory source's data.

        Raises:
            ProtocolError: the TASK carries no pipeline.
            Exception: the pipeline cannot be fetched or unpickled (the worker reports it
                as the task's failure).
        """
        if task.fingerprint is not None and task.fingerprint in self.inherited:
            return self.inherited[task.fingerprint]
        if task.fingerprint is not None:
            with self._lock:
                found = self._warm.pop(task.fingerprint, None)
                if found is not None:  # (kept warm: not fetched or unpickled again)
                    self._warm[task.fingerprint] = (found[0], found[1], time.monotonic())
                    return found[0]
        pipeline, size = self._loaded(task, payload)
        if task.fingerprint is not None:
            with self._lock:
                self._warm[task.fingerprint] = (pipeline, size, time.monotonic())
                self._expire(time.monotonic())
        return pipeline

    def _loaded(self, task: messages.Task, payload: list[Any]) -> tuple[Pipeline, int]:
        """The pipeline of ``task`` fetched (or taken from ``payload``) and unpickled,
        and its pickled size."""
        ref = task.pipeline
        if ref is not None and ref.get("inherited") is True:
            raise RuntimeError(
                "this job's pipeline reaches only the workers its Loader forked (embedded "
                "mode), and this worker is not one of them")
        if ref is not None:
            endpoint, digest, size = ref["endpoint"], ref["sha256"], ref["bytes"]
            with self._lock:
                blob: Any = self.blobs.get(
                    digest, size, lambda: self._fetch(endpoint, "pipeline").payload[0].buffer)
        elif payload and payload[0].buffer.nbytes:
            blob = payload[0].buffer
        else:
            raise ProtocolError("TASK without a pipeline")
        pipeline = cloudpickle.loads(blob)
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"the task's pipeline is a {type(pipeline).__name__}")
        size = len(memoryview(blob))
        where = task.source_data
        if where is not None:
            pipeline, fetched = self._with_source(pipeline, where)
            size += fetched
        return pipeline, size

    def _with_source(self, pipeline: Pipeline, where: dict[str, Any]
                     ) -> tuple[Pipeline, int]:
        """Put a large in-memory source's data, fetched from its Loader, back in place
        (``where``: TASK.source_data, checked by its record); and the bytes fetched."""
        reply = self._fetch(where["endpoint"], "source")
        fetched = sum(frame.buffer.nbytes for frame in reply.payload)
        outer = pipeline.source
        source = outer.innermost()  # (under a cache, say)
        if where["kind"] == "arrays" and isinstance(source, ArraysSource):
            structure = codec.decode([frame.buffer for frame in reply.payload])
            return Pipeline(outer.with_innermost(dataclasses.replace(
                source, structure=structure)), pipeline.stages), fetched
        if where["kind"] == "items" and isinstance(source, ItemsSource):
            items = cloudpickle.loads(reply.payload[0].buffer)
            return Pipeline(outer.with_innermost(dataclasses.replace(
                source, items=tuple(items))), pipeline.stages), fetched
        raise ProtocolError(f"source data of kind {where['kind']!r} does not fit a "
                            f"{type(source).__name__}")

    def _fetch(self, endpoint: str, what: str) -> Message:
        """Ask the Loader at ``endpoint`` for ``what`` ("pipeline" or "source")."""
        sock = make_socket(self.context, zmq.DEALER, self.keys)
        try:
            sock.connect(endpoint)
            sock.send_multipart(encode(Command.FETCH, {"what": what}))
            if not sock.poll(int(FETCH_TIMEOUT * 1000)):
                raise TimeoutError(f"the Loader serving this job's {what} at {endpoint} did "
                                   f"not answer within {FETCH_TIMEOUT:.0f} s (worker pid "
                                   f"{os.getpid()})")
            reply = decode(sock.recv_multipart(copy=False))
        finally:
            sock.close(0)
        if reply.command is not Command.SOURCE or not reply.payload:
            raise ProtocolError(f"the Loader answered FETCH without the {what}")
        messages.decode(reply)  # its kind checked
        return reply


class Loading:
    """A task's pipeline being loaded (fetched, unpickled, its source fetched) on a thread
    of its own, so that the worker's loop keeps heartbeating and serving meanwhile; once
    done, ``wake`` (the loop's) is called, so that the task begins at once rather than at
    the loop's next turn. Inherited pipelines need no thread."""

    def __init__(self, supply: Supply, task: messages.Task, payload: list[Any],
                 wake: Callable[[], None] | None = None) -> None:
        self.pipeline: Pipeline | None = None
        self.error: BaseException | None = None
        self._finished = True
        if task.fingerprint is not None and task.fingerprint in supply.inherited:
            self.pipeline = supply.inherited[task.fingerprint]
            return
        self._finished = False
        self._wake = wake
        threading.Thread(target=self._run, args=(supply, task, payload), daemon=True,
                         name="zloader-task-load").start()

    def _run(self, supply: Supply, task: messages.Task, payload: list[Any]) -> None:
        try:
            self.pipeline = supply.load(task, payload)
        except BaseException as exc:  # reported as the task's failure
            self.error = exc
        self._finished = True
        if self._wake is not None:
            self._wake()

    def done(self) -> bool:
        return self._finished

