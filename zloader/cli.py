"""Command-line entry points: ``zloader``, ``zloader-broker`` and ``zloader-worker``."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from zloader._defaults import (
    ACTUATOR_INTERVAL,
    AUTOSCALE_COOLDOWN,
    DEMO_BATCH_SIZE,
    DEMO_IMAGES,
    DEMO_SIZE,
    DEMO_WORKERS,
    HEARTBEAT,
    MAX_JOBS,
    MAX_PEER_JOBS,
    MAX_PEER_PIPELINE_BYTES,
    MAX_PIPELINE_BYTES_HELD,
    RESTART_DELAY,
    RESTART_MAX_DELAY,
    STATUS_TIMEOUT,
    TOP_INTERVAL,
)
from zloader._version import __version__

__all__ = ["broker_main", "main", "worker_main"]


class Progress:
    """A one-line progress bar on a terminal, or a line every few seconds elsewhere."""

    def __init__(self, total: int, unit: str, stream: TextIO, interval: float = 0.1) -> None:
        self.total = total
        self.unit = unit
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = interval if self.tty else 5.0
        self.start = time.monotonic()
        self.last = 0.0
        self.done = 0

    def update(self, count: int) -> None:
        self.done += count
        now = time.monotonic()
        if now - self.last >= self.interval or self.done >= self.total:
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        fraction = min(self.done / self.total, 1.0) if self.total else 1.0
        bar = "#" * int(fraction * 30)
        line = (f"[{bar:<30}] {self.done}/{self.total} {self.unit} "
                f"{self.done / elapsed:,.0f} {self.unit}/s")
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _version_text() -> str:
    """``zloader 1.2.3 (compiled core)``, or which kernels run and why (zloader/_native.py)."""
    from zloader import _native

    return f"zloader {__version__} ({_native.summary()})"


def _demo(args: argparse.Namespace) -> int:
    from zloader.demo import demo_pipeline
    from zloader.loader import Loader

    pipeline = demo_pipeline(args.images, args.batch_size, args.size)
    print(f"zloader demo: {args.images} images ({args.size}x{args.size}, decode + crop + flip + "
          f"normalize, batches of {args.batch_size}) on {args.workers} embedded workers",
          file=sys.stderr)
    start = time.monotonic()
    with Loader(pipeline, num_workers=args.workers) as loader:
        embedded = _run_demo(loader, args.images)
    total = time.monotonic() - start
    in_process = _run_demo(pipeline, args.images) if args.compare else None
    print(f"zloader demo: {args.images / embedded:,.0f} images/s with {args.workers} workers "
          f"({embedded:.2f} s, {total:.2f} s with start-up and shutdown)"
          + (f"; in this process alone: {args.images / in_process:,.0f} images/s "
             f"({embedded and in_process / embedded:.2f}x)" if in_process else ""))
    return 0


def _run_demo(batches: Any, total: int) -> float:
    progress = Progress(total, "images", sys.stderr)
    start = time.monotonic()
    for batch in batches:
        progress.update(len(batch["label"]))
    progress.close()
    return max(time.monotonic() - start, 1e-9)


def _fingerprint(args: argparse.Namespace) -> int:
    from zloader.pipeline import Pipeline

    module_name, _, attribute = args.target.partition(":")
    if not attribute:
        print("zloader fingerprint: give MODULE:NAME, e.g. my_training.data:pipeline",
              file=sys.stderr)
        return 2
    # As `python -m` would: the working directory first on the path (a console script's
    # sys.path starts with the script's own directory instead).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        print(f"zloader fingerprint: cannot import {module_name} ({exc}); run this where "
              "`python -m` would find it, or install it", file=sys.stderr)
        return 2
    for part in attribute.split("."):
        if not hasattr(obj, part):
            print(f"zloader fingerprint: {args.target}: {type(obj).__name__} "
                  f"{getattr(obj, '__name__', '')} has no attribute {part!r}", file=sys.stderr)
            return 2
        obj = getattr(obj, part)
    if callable(obj) and not isinstance(obj, Pipeline):
        obj = obj()
    if not isinstance(obj, Pipeline):
        print(f"zloader fingerprint: {args.target} is a {type(obj).__name__}, not a Pipeline",
              file=sys.stderr)
        return 2
    print(obj.fingerprint if obj.shareable else f"{obj.fingerprint} (unshareable)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zloader", description="zloader: ML input pipelines on CPU worker processes.")
    parser.add_argument("--version", action="version", version=_version_text())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _demo_parser(commands)
    fp = commands.add_parser(
        "fingerprint", help="print the fingerprint of a pipeline",
        description="Import MODULE (from the working directory first, as `python -m` "
                    "does) and print the fingerprint of the Pipeline at NAME (or "
                    "returned by calling NAME with no arguments).")
    fp.add_argument("target", metavar="MODULE:NAME")
    fp.set_defaults(run=_fingerprint)
    _status_parser(commands)
    _top_parser(commands)
    keygen = commands.add_parser(
        "keygen", help="create a keys directory for an authenticated service",
        description="Create DIR (mode 0700) holding a server and a client CURVE key pair and "
                    "authorized/, the public keys allowed in (the client's). Give the same "
                    "DIR to the broker, the workers, the trainers and `zloader status` "
                    "(--keys DIR, keys=DIR or $ZLOADER_KEYS); copy it to every host and keep "
                    "it private.")
    keygen.add_argument("dir", metavar="DIR", help="the directory to create (new or empty)")
    keygen.set_defaults(run=_keygen)
    from zloader._cache_cli import cache_parser

    cache_parser(commands)
    return parser


def _demo_parser(commands: Any) -> None:
    """``zloader demo``: its options, and :func:`_demo` to run it."""
    demo = commands.add_parser(
        "demo", help="run the demo job (synthetic image decode and augmentation)",
        description="Run a synthetic image pipeline (decode, random crop, flip, normalize, "
                    "batch) and report its throughput.")
    demo.add_argument("--images", type=_positive, default=DEMO_IMAGES,
                      help="images (default 20000)")
    demo.add_argument("--batch-size", type=_positive, default=DEMO_BATCH_SIZE, help="default 64")
    demo.add_argument("--size", type=_positive, default=DEMO_SIZE, help="image side (default 64)")
    demo.add_argument("--workers", type=_positive, default=DEMO_WORKERS, help="worker processes "
                      "(default 2)")
    demo.add_argument("--no-compare", dest="compare", action="store_false",
                      help="skip the in-process comparison run")
    demo.set_defaults(run=_demo)


def _status_parser(commands: Any) -> None:
    """``zloader status``: its options, and :func:`_status` to run it."""
    status = commands.add_parser(
        "status", help="show a broker's workers and jobs",
        description="Ask a broker for its workers (host, pid, tasks, elements/s) and jobs "
                    "(job id, name, consumers, workers, share of the worker pool, "
                    "starvation, elements and bytes served, fingerprint).")
    _broker_arguments(status)
    status.add_argument("--json", action="store_true",
                        help='print one JSON object {"summary": {...}, "workers": [...], '
                             '"jobs": [...], "left_off": {...}, "next": {...}}: one page (a '
                             "reply holds what fits in one message; left_off counts the "
                             "rest, next is where the next page starts)")
    status.add_argument("--all", action="store_true",
                        help="ask for every page: all the workers and jobs")
    status.add_argument("--from", dest="start", type=_page_start, default=None,
                        metavar="JSON",
                        help='the page to show: a reply\'s "next", e.g. '
                             '\'{"workers": 0, "jobs": 512}\'')
    status.set_defaults(run=_status)


def _top_parser(commands: Any) -> None:
    """``zloader top``: its options, and :func:`_top` to run it."""
    top = commands.add_parser(
        "top", help="a live view of a broker's jobs and workers",
        description="Refresh, every INTERVAL seconds, a view of the service: per job its "
                    "consumers, workers, share of the pool, elements/s and bytes/s since the "
                    "last refresh, and "
                    "the share of time its consumers waited for data (starvation); per "
                    "worker its job, elements/s and CPU use. Ctrl-C quits.")
    _broker_arguments(top)
    top.add_argument("--interval", type=float, default=TOP_INTERVAL,
                     help="seconds between refreshes (default 2)")
    top.add_argument("--iterations", type=int, default=0,
                     help="stop after this many refreshes (default 0: until Ctrl-C)")
    top.set_defaults(run=_top)


def _keygen(args: argparse.Namespace) -> int:
    from zloader.transport.keys import KeysError, keygen

    try:
        keys = keygen(args.dir)
    except (KeysError, OSError) as exc:
        print(f"zloader keygen: {exc}", file=sys.stderr)
        return 2
    print(f"created {keys.path}: pass --keys {keys.path} (or keys=, or ZLOADER_KEYS) to the "
          "broker, the workers and the trainers")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _address(text: str) -> str:
    from zloader._check import address

    try:
        return address("the address", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("the address ")) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``zloader``: the user-facing command."""
    args = build_parser().parse_args(argv)
    result: int = args.run(args)
    return result


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def broker_main(argv: Sequence[str] | None = None) -> int:
    """``zloader-broker``: run a broker until SIGTERM or Ctrl-C."""
    import zmq

    from zloader.broker import Broker
    from zloader.broker.descriptors import raise_descriptor_limit
    from zloader.broker.journal import JournalVersionError
    from zloader.broker.records import Limits

    parser = _broker_parser()
    args = parser.parse_args(argv)
    _check_broker_args(parser, args)
    keys = _keys(parser, args.keys)
    _logging(args.log_level)
    _broker_exposure(parser, args, keys)
    if args.work_dir:
        _work_dir(parser, args.work_dir, args.bind)
    metrics = (args.metrics_bind, args.metrics_port) if args.metrics_port else None
    limits = Limits(jobs=args.max_jobs, peer_jobs=args.max_peer_jobs,
                    pipeline_bytes=args.max_pipeline_bytes,
                    peer_pipeline_bytes=args.max_peer_pipeline_bytes)
    raise_descriptor_limit()
    try:
        broker = Broker(args.bind, heartbeat=args.heartbeat, keys=keys,
                        work_dir=args.work_dir, metrics=metrics,
                        cooldown=args.autoscale_cooldown, limits=limits)
    except JournalVersionError as exc:
        parser.error(str(exc))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: broker._stop.set())
    logging.getLogger("zloader.broker").info("listening on %s", args.bind)
    try:
        broker.serve()
    except zmq.ZMQError as exc:
        print(f"zloader-broker: cannot listen on {args.bind}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"zloader-broker: cannot serve metrics on {args.metrics_bind}:"
              f"{args.metrics_port}: {exc}", file=sys.stderr)
        return 1
    return 0


def _broker_parser() -> argparse.ArgumentParser:
    """The command line of ``zloader-broker``."""
    parser = argparse.ArgumentParser(
        prog="zloader-broker", description="Run a zloader broker: it hands the splits of "
        "each job's input to workers and tells consumers where to read.")
    parser.add_argument("--bind", default="tcp://127.0.0.1:5555",
                        help="address to listen on (default tcp://127.0.0.1:5555: loopback; "
                             "give tcp://0.0.0.0:5555 to accept other hosts)")
    parser.add_argument("--work-dir", default=None, metavar="DIR",
                        help="a directory for the broker's files, created if missing: "
                             "journal.jsonl and pipelines/ (its state: a broker restarted on "
                             "the same DIR resumes every job), broker.log (its log) and "
                             "broker.json (address and pid, for scripts); one another "
                             "user owns or may write to is refused. Without it a "
                             "restarted broker starts its jobs over")
    parser.add_argument("--keys", default=None, metavar="DIR",
                        help="a keys directory (zloader keygen DIR): only peers holding an "
                             "authorized key may register pipelines, read data or serve as "
                             "workers; default $ZLOADER_KEYS")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a non-loopback --bind or --metrics-bind without --keys "
                             "(a trusted network only: whoever reaches the port can run code "
                             "on the workers)")
    parser.add_argument("--heartbeat", type=float, default=HEARTBEAT, metavar="SECONDS",
                        help="seconds between heartbeats (default 1); workers and consumers "
                             "follow the broker's, and a peer silent for three is taken for "
                             "dead. Shorter notices deaths sooner; too short for a loaded "
                             "host gives up on live peers")
    _metrics_arguments(parser)
    parser.add_argument("--autoscale-cooldown", type=float, default=AUTOSCALE_COOLDOWN,
                        metavar="SECONDS",
                        help="seconds of consumers' starvation the autoscaler samples "
                             "between two changes of a job's desired_workers, judging on the "
                             "second half (default 30; see `zloader-worker --autoscale`)")
    _limit_arguments(parser)
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--version", action="version", version=_version_text())
    return parser


def _metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """--metrics-port and --metrics-bind: the broker's Prometheus endpoint."""
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics at http://ADDR:PORT/metrics (per "
                             "job: elements, bytes, consumers' wait and starvation, workers; "
                             "per worker: elements, CPU, credits, ring fill)")
    parser.add_argument("--metrics-bind", default="127.0.0.1", metavar="ADDR",
                        help="the address the metrics endpoint listens on (default "
                             "127.0.0.1; 0.0.0.0 for a scraper on another host, which "
                             "without --keys needs --insecure)")


def _check_broker_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The broker's numeric options in range; a usage error otherwise."""
    from zloader.transport.protocol import HEARTBEAT_RANGE, heartbeat

    if not 0 < args.autoscale_cooldown <= 3600:
        parser.error(f"--autoscale-cooldown must be between 0 and 3600 seconds, got "
                     f"{args.autoscale_cooldown}")
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        parser.error(f"--metrics-port must be a port number (1-65535), got {args.metrics_port}")
    if heartbeat(args.heartbeat) is None:
        parser.error(f"--heartbeat must be between {HEARTBEAT_RANGE[0]} and "
                     f"{HEARTBEAT_RANGE[1]:.0f} seconds, got {args.heartbeat}")


def _broker_exposure(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     keys: Any) -> None:
    """The rule for addresses beyond this host (:func:`_exposed`) applied to --bind and
    --metrics-bind; without keys, a warning that whoever reaches the broker can run code."""
    _exposed(parser, keys, args.insecure, "--bind", args.bind, "accepts other hosts",
             "anyone who reaches it can run code on the workers")
    if args.metrics_port:
        _exposed(parser, keys, args.insecure, "--metrics-bind", args.metrics_bind,
                 "serves metrics to other hosts",
                 "the service is meant for this host alone")
    if keys is None:
        logging.getLogger("zloader.broker").warning(
            "no --keys: any user who can reach %s (any user of this host, for loopback) can "
            "submit code for the workers to run; see `zloader keygen`", args.bind)


def _limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The broker's bounds on what peers make it hold (docs/reliability.md, "Floods")."""
    parser.add_argument("--max-jobs", type=_positive, default=MAX_JOBS, metavar="N",
                        help=f"jobs held at once; a REGISTER of one more is refused "
                             f"(default {MAX_JOBS})")
    parser.add_argument("--max-peer-jobs", type=_positive, default=MAX_PEER_JOBS,
                        metavar="N",
                        help=f"jobs one connection may have made and still hold (a Loader "
                             f"makes one; default {MAX_PEER_JOBS})")
    parser.add_argument("--max-pipeline-bytes", type=_positive,
                        default=MAX_PIPELINE_BYTES_HELD, metavar="BYTES",
                        help=f"bytes of pickled pipelines held for all jobs (default "
                             f"{MAX_PIPELINE_BYTES_HELD})")
    parser.add_argument("--max-peer-pipeline-bytes", type=_positive,
                        default=MAX_PEER_PIPELINE_BYTES, metavar="BYTES",
                        help=f"bytes of pickled pipelines held for the jobs one connection "
                             f"made (default {MAX_PEER_PIPELINE_BYTES})")


def _exposed(parser: argparse.ArgumentParser, keys: Any, insecure: bool, flag: str,
             address: str, reach: str, risk: str) -> None:
    """The rule for every address beyond this host: without keys, refused (a usage error
    naming ``flag``, what it exposes and the fix) unless ``--insecure``.

    Args:
        address: a ZeroMQ endpoint, or a bare host for an HTTP bind.
        reach: what ``flag`` does beyond this host ("accepts other hosts").
        risk: what anyone there could do without keys.
    """
    from zloader._host import loopback

    endpoint = address if "://" in address else f"tcp://{address}:0"
    if keys is None and not insecure and not loopback(endpoint):
        parser.error(f"{flag} {address} {reach}, and without --keys {risk}: make keys with "
                     "`zloader keygen DIR` and pass --keys DIR (on every host), or pass "
                     "--insecure on a trusted network")


def _keys(parser: argparse.ArgumentParser, path: str | None) -> Any:
    """``--keys`` (or $ZLOADER_KEYS) loaded, or None; a bad directory is a usage error."""
    from zloader.transport.keys import KeysError, resolve

    try:
        return resolve(path)
    except KeysError as exc:
        parser.error(str(exc))


def _work_dir(parser: argparse.ArgumentParser, path: str, bind: str) -> None:
    """Make or check ``--work-dir`` (zloader.broker.journal.work_dir), log to it and note the
    broker's address there; one another user could write to is a usage error."""
    from zloader.broker.journal import WorkDirError, work_dir

    try:
        work_dir(path)
    except WorkDirError as exc:
        parser.error(str(exc))
    handler = logging.FileHandler(os.path.join(path, "broker.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    with open(os.path.join(path, "broker.json"), "w") as f:
        json.dump({"address": bind, "pid": os.getpid(), "version": __version__}, f)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """``zloader-worker``: run worker processes until SIGTERM or Ctrl-C."""
    parser = _worker_parser()
    args = parser.parse_args(argv)
    _logging(args.log_level)
    keys = _keys(parser, args.keys)

    bind = args.bind or f"tcp://{args.advertise or '127.0.0.1'}:*"
    _check_worker_args(parser, args, keys, bind)
    if args.autoscale:
        args.max_processes = args.max_processes or os.cpu_count() or 1
        with _blob_dir(args):
            return _autoscale(args, keys)
    if args.processes > 1:
        with _blob_dir(args):
            return _supervise(args)
    from zloader.worker import BrokerRefused, WorkerProcess

    worker = WorkerProcess(args.broker, bind, advertise=args.advertise, parent=args.parent,
                           keys=keys, plain_data=args.plain_data,
                           forward_output=args.parent is None, blob_dir=args.blob_dir)
    # SIGTERM drains: the splits taken are finished and delivered, then the worker leaves
    # (a Loader's own workers, --parent, just stop: their consumer is leaving).
    signal.signal(signal.SIGTERM, lambda *_: worker.halt() if args.parent is not None
                  else worker.drain())
    if args.parent is not None:
        # The worker loop exits within 0.1 s of its parent's death (it watches getppid();
        # PR_SET_PDEATHSIG would fire when the *thread* that started it exits, which a
        # Loader made in a short-lived thread, as tf.data does, must survive).
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C; it stops us
    else:
        signal.signal(signal.SIGINT, lambda *_: worker.halt())
    try:
        worker.run()
    except BrokerRefused as exc:
        print(f"zloader-worker: {exc}", file=sys.stderr)
        return 1
    return 0


def _worker_parser() -> argparse.ArgumentParser:
    """The command line of ``zloader-worker``."""
    parser = argparse.ArgumentParser(
        prog="zloader-worker", description="Run zloader worker processes attached to a broker.")
    parser.add_argument("--broker", required=True, type=_address,
                        help="the broker's address, e.g. "
                        "tcp://10.0.0.5:5555")
    parser.add_argument("--processes", type=_positive, default=1,
                        help="worker processes to run on this host (default 1)")
    parser.add_argument("--advertise", default=None, help="host name or address consumers "
                        "use to reach these workers (default 127.0.0.1, loopback only)")
    parser.add_argument("--restart-delay", type=float, default=RESTART_DELAY,
                        metavar="SECONDS",
                        help="with --processes N > 1, seconds before a worker process that "
                             "died is replaced, doubled at each death of its slot up to "
                             f"--restart-max-delay (default {RESTART_DELAY:g})")
    parser.add_argument("--restart-max-delay", type=float, default=RESTART_MAX_DELAY,
                        metavar="SECONDS",
                        help="the longest wait before a dead worker process is replaced "
                             f"(default {RESTART_MAX_DELAY:g})")
    _worker_key_arguments(parser)
    _autoscale_arguments(parser)
    parser.add_argument("--bind", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parent", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--blob-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--version", action="version", version=_version_text())
    return parser


def _worker_key_arguments(parser: argparse.ArgumentParser) -> None:
    """--keys, --insecure and --plain-data: how a worker authenticates and serves its data."""
    parser.add_argument("--keys", default=None, metavar="DIR",
                        help="a keys directory (zloader keygen DIR), as the broker's; "
                             "default $ZLOADER_KEYS")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a non-loopback --broker or --advertise without --keys (a "
                             "trusted network only: whoever answers at the broker's address "
                             "can run code here, whoever reaches the data port can read the "
                             "data)")
    parser.add_argument("--plain-data", action="store_true",
                        help="with --keys, serve data without encryption: consumers prove "
                             "they hold the keys with a token (ZeroMQ PLAIN), which anyone "
                             "watching the network could replay; a trusted network only. "
                             "Faster than CURVE on TCP (see the transport benchmark)")


def _autoscale_arguments(parser: argparse.ArgumentParser) -> None:
    """--autoscale, --max-processes and --autoscale-interval: following the broker's
    desired_workers on this host."""
    parser.add_argument("--autoscale", action="store_true",
                        help="grow and shrink the worker processes on this host to follow "
                             "the broker's desired_workers (see `zloader status`): start "
                             "more while jobs lack workers, drain the ones it marks surplus; "
                             "--processes is then the count to start with. Without "
                             "--advertise its workers listen on loopback, so it grows only "
                             "for jobs whose trainers run on this host")
    parser.add_argument("--max-processes", type=_positive, default=None, metavar="N",
                        help="with --autoscale, the core budget: at most N worker "
                             "processes on this host (default: its core count)")
    parser.add_argument("--autoscale-interval", type=float, default=ACTUATOR_INTERVAL,
                        metavar="SECONDS",
                        help="with --autoscale, seconds between two looks at the broker's "
                             "status (default 1)")


def _check_worker_args(parser: argparse.ArgumentParser, args: argparse.Namespace, keys: Any,
                       bind: str) -> None:
    """The worker's options consistent, and its addresses beyond this host allowed (see
    :func:`_exposed`); a usage error otherwise."""
    if args.plain_data and keys is None:
        parser.error("--plain-data needs --keys: it replaces CURVE on the data socket with a "
                     "token from the keys directory")
    _exposed(parser, keys, args.insecure, "--broker", args.broker, "is beyond this host",
             "whatever answers there can run code on this worker")
    _exposed(parser, keys, args.insecure, "--advertise", bind,
             "opens the data port to other hosts", "anyone who reaches it can read the data")
    if args.max_processes is not None and not args.autoscale:
        parser.error("--max-processes is the budget of --autoscale: pass --autoscale too, "
                     "or --processes N for a fixed count")
    if args.autoscale:
        if args.bind or args.parent is not None:
            parser.error("--autoscale runs worker processes of its own: it takes neither "
                         "--bind nor --parent")
        if not 0 < args.autoscale_interval <= 60:
            parser.error("--autoscale-interval must be between 0 and 60 seconds")
    elif not 0 < args.restart_delay <= args.restart_max_delay:
        parser.error("--restart-delay must be above 0 and at most --restart-max-delay, got "
                     f"{args.restart_delay:g} and {args.restart_max_delay:g}")


def _worker_command(args: argparse.Namespace) -> list[str]:
    """The command that runs one worker process with this command's settings."""
    from zloader._command import worker_command

    return worker_command(args.broker, advertise=args.advertise, keys=args.keys,
                          insecure=args.insecure, plain_data=args.plain_data,
                          blob_dir=args.blob_dir, log_level=args.log_level)


@contextlib.contextmanager
def _blob_dir(args: argparse.Namespace) -> Iterator[None]:
    """A private directory where this host's worker processes keep the pipelines they
    fetch, so that the host fetches each once (zloader/blobs.py); removed on exit, or by
    the next Loader's sweep if this process is killed (its name carries our pid)."""
    import shutil
    import tempfile

    args.blob_dir = tempfile.mkdtemp(prefix=f"zloader-{os.getpid()}-")
    try:
        yield
    finally:
        shutil.rmtree(args.blob_dir, ignore_errors=True)


def _supervise(args: argparse.Namespace) -> int:
    """Keep ``--processes`` workers running as children until SIGTERM or Ctrl-C, replacing
    each that dies (zloader/actuator.py: ``Supervisor``); then drain them. Exits 1 if any
    died on the way."""
    from zloader.actuator import Backoff, Supervisor

    supervisor = Supervisor(_worker_command(args), args.processes,
                            lambda: Backoff(args.restart_delay, args.restart_max_delay))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: supervisor.request_stop())
    return supervisor.run()


def _autoscale(args: argparse.Namespace, keys: Any) -> int:
    """``--autoscale``: follow the broker's desired_workers (zloader/actuator.py)."""
    from zloader._host import loopback
    from zloader.actuator import LocalActuator

    local = not args.advertise or loopback(f"tcp://{args.advertise}:0")
    actuator = LocalActuator(args.broker, keys, _worker_command(args), args.max_processes,
                             start=min(args.processes, args.max_processes),
                             interval=args.autoscale_interval, loopback_only=local)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: actuator.stop.set())
    actuator.run()
    return 0


def _broker_arguments(parser: argparse.ArgumentParser) -> None:
    """--broker, --timeout and --keys: how `zloader status` and `zloader top` reach it."""
    parser.add_argument("--broker", default="tcp://127.0.0.1:5555", type=_address,
                        help="the broker's address (default tcp://127.0.0.1:5555)")
    parser.add_argument("--timeout", type=float, default=STATUS_TIMEOUT,
                        help="seconds to wait (default 5)")
    parser.add_argument("--keys", default=None, metavar="DIR",
                        help="the broker's keys directory; default $ZLOADER_KEYS")


def _status_keys(command: str, path: str | None) -> Any:
    from zloader.transport.keys import KeysError, resolve

    try:
        return resolve(path)
    except KeysError as exc:
        print(f"zloader {command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _top(args: argparse.Namespace) -> int:
    from zloader._status import Unanswered, fetch_status, top_frame

    keys = _status_keys("top", args.keys)
    if args.interval <= 0:
        print("zloader top: --interval must be a positive number of seconds", file=sys.stderr)
        return 2
    previous: tuple[float, dict[str, Any]] | None = None
    frames = 0
    try:
        while True:
            try:
                status = fetch_status(args.broker, keys, args.timeout)
            except Unanswered as exc:
                print(f"zloader top: {exc}", file=sys.stderr)
                return 1
            now = time.monotonic()
            text = top_frame(status, previous, now, args.broker)
            previous = (now, status)
            if sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")  # clear the terminal, cursor home
            print(text, flush=True)
            frames += 1
            if args.iterations and frames >= args.iterations:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _page_start(text: str) -> dict[str, int]:
    """``--from``: a STATUS reply's ``next``, ``{"workers": i, "jobs": j}``."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not (isinstance(value, dict) and set(value) <= {"workers", "jobs"} and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for v in value.values())):
        raise argparse.ArgumentTypeError(
            f'must be a JSON object {{"workers": N, "jobs": N}} (a reply\'s "next"), got '
            f"{text[:60]!r}")
    return value


def _status(args: argparse.Namespace) -> int:
    from zloader._status import Unanswered, fetch_page, fetch_status, status_text

    keys = _status_keys("status", args.keys)
    if args.all and args.start is not None:
        print("zloader status: --all shows every page; leave out --from", file=sys.stderr)
        return 2
    try:
        status = (fetch_status(args.broker, keys, args.timeout) if args.all
                  else fetch_page(args.broker, keys, args.timeout, args.start))
    except Unanswered as exc:
        print(f"zloader status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({key: status.get(key) for key in
                          ("summary", "workers", "jobs", "left_off", "next")}))
        return 0
    print(status_text(status))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
