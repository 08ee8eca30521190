"""Ask a broker for its status (``zloader status``, ``zloader top``, the actuators), and
show it as text (:func:`status_text`, :func:`top_frame`).

A STATUS reply is bounded (``zloader.broker.status.status``): the broker's summary, then
as many workers and jobs as fit in one message, and ``next``, where the next page starts.
:func:`fetch_page` asks for one page; :func:`fetch_status` follows ``next`` and returns
every worker and job.
"""

from __future__ import annotations

import json
from typing import Any

import zmq

from zloader.transport import messages
from zloader.transport.keys import Keys
from zloader.transport.protocol import ProtocolError, decode, encode
from zloader.transport.sockets import make_socket

__all__ = ["Unanswered", "fetch_page", "fetch_status", "status_text", "top_frame"]


class Unanswered(Exception):
    """The broker did not answer a status request in time, or not with a status."""


def fetch_page(broker: str, keys: Keys | None, timeout: float,
               start: dict[str, int] | None = None,
               actuator: dict[str, Any] | None = None) -> dict[str, Any]:
    """One STATUS reply from ``broker``: the page that begins at ``start`` (a reply's
    ``next``; None: the first). ``actuator``: the asker is an actuator, ``{id, cap,
    workers}`` (the most workers it runs, and the ids of those it runs: the broker counts
    its cap in the fleet's).

    Raises:
        Unanswered: none within ``timeout`` seconds, an answer that is not a status (the
            broker refused the request: another protocol version), or a malformed one (a
            broker older than paged replies may send one larger than a message).
    """
    context = zmq.Context()
    sock = make_socket(context, zmq.DEALER, keys)
    try:
        sock.connect(broker)
        report: dict[str, Any] = {"from": start} if start else {}
        if actuator is not None:
            report["actuator"] = actuator
        request = messages.Status(report=report)
        sock.send_multipart(encode(request.COMMAND, messages.encode(request)))
        if not sock.poll(int(timeout * 1000)):
            raise Unanswered(
                f"no answer from {broker} within {timeout:.0f} s (is zloader-broker running "
                "there? does it want --keys, or other keys?)")
        try:
            answer = messages.decode(decode(sock.recv_multipart()))
        except ProtocolError as exc:
            raise Unanswered(f"{broker} sent a status this client cannot read ({exc}); "
                             "is the broker older than this zloader?") from None
        if isinstance(answer, messages.Error):
            raise Unanswered(f"{broker} refused the status request: {answer.message}")
        if not isinstance(answer, messages.Status):
            raise Unanswered(f"{broker} answered {answer.COMMAND.name}, not STATUS")
        return answer.report
    finally:
        sock.close(0)
        context.term()


def fetch_status(broker: str, keys: Keys | None, timeout: float,
                 actuator: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every worker and job of ``broker``: its STATUS pages, followed to the last and
    joined (``workers``, ``jobs``, ``summary`` and ``rejected`` of the last page);
    ``actuator``: as :func:`fetch_page`'s.

    Raises:
        Unanswered: as :func:`fetch_page`, for any page.
    """
    report = fetch_page(broker, keys, timeout, actuator=actuator)
    workers, jobs = list(report.get("workers", [])), list(report.get("jobs", []))
    start = report.get("next")
    while isinstance(start, dict):
        page = fetch_page(broker, keys, timeout, start)
        workers += page.get("workers", [])
        jobs += page.get("jobs", [])
        following = page.get("next")
        if following == start or not (page.get("workers") or page.get("jobs")):
            break  # no progress (the broker's lists shrank meanwhile): what we have
        report, start = page, following
    return {**report, "workers": workers, "jobs": jobs, "next": None,
            "left_off": {"workers": 0, "jobs": 0}}


def top_frame(status: dict[str, Any], previous: tuple[float, dict[str, Any]] | None,
               now: float, broker: str) -> str:
    """One screen of ``zloader top``: rates are over the time since ``previous``."""
    elapsed = now - previous[0] if previous is not None else 0.0
    before = {j["job"]: j for j in previous[1].get("jobs", [])} if previous else {}
    workers_before = {w["worker"]: w for w in previous[1].get("workers", [])} if previous \
        else {}

    def rate(now_value: Any, then: Any) -> str:
        if not elapsed or not isinstance(then, (int, float)):
            return "-"
        return f"{max(0.0, (now_value - then) / elapsed):,.0f}"

    jobs, workers = status.get("jobs", []), status.get("workers", [])
    lines = [f"zloader top: {broker}, {len(jobs)} jobs, {len(workers)} workers, "
             f"{status.get('rejected', 0)} messages rejected", "",
             f"  {'job':<16} {'name':<16} {'consumers':>9} {'workers':>7} {'share':>6} "
             f"{'wanted':>6} {'elements/s':>12} {'MB/s':>9} {'starved':>8}"]
    for job in jobs:
        name = "(shared)" if job.get("shared") else job.get("name") or "-"
        old = before.get(job["job"], {})
        mb = rate(job["bytes"] / 1e6, old["bytes"] / 1e6 if "bytes" in old else None)
        lines.append(f"  {job['job']:<16} {str(name)[:16]:<16} {job['consumers']:>9} "
                     f"{job['workers']:>7} {job.get('share', 0.0):>6.1f} "
                     f"{job.get('desired_workers', '-'):>6} "
                     f"{rate(job['elements'], old.get('elements')):>12} {mb:>9} "
                     f"{job.get('starvation', 0.0):>8.0%}")
    lines += ["", f"  {'worker':<18} {'host':<16} {'pid':>8} {'job':<18} {'elements/s':>12} "
                  f"{'cpu':>6}"]
    for worker in workers:
        old = workers_before.get(worker["worker"], {})
        cpu = rate(worker.get("cpu_seconds", 0.0) * 100, old.get("cpu_seconds", 0.0) * 100
                   if "cpu_seconds" in old else None)
        lines.append(f"  {worker['worker']:<18} {worker['host'][:16]:<16} {worker['pid']:>8} "
                     f"{str(worker.get('job') or '-')[:18]:<18} "
                     f"{rate(worker['elements'], old.get('elements')):>12} "
                     f"{cpu + '%' if cpu != '-' else '-':>6}")
    return "\n".join(lines)


def status_text(status: dict[str, Any]) -> str:
    """``zloader status`` as tables, with what the page left off."""
    summary = status.get("summary") or {}
    left = status.get("left_off") or {}
    cap = summary.get("worker_cap")
    lines = [f"workers ({summary.get('workers', len(status.get('workers', [])))}"
             + (f"; the actuators' cap {cap}" if cap is not None else "") + ")",
             f"  {'host':<20} {'pid':>8} {'tasks':>5} {'elements/s':>12} {'cpu s':>9}"]
    for w in status.get("workers", []):
        lines.append(f"  {w['host']:<20} {w['pid']:>8} {w['tasks']:>5} "
                     f"{w['elements_per_second']:>12,.0f} {w.get('cpu_seconds', 0.0):>9,.1f}"
                     + ("  (surplus)" if w.get("surplus") else ""))
        if w.get("warm"):
            lines.append(f"    warm: {', '.join(str(f)[:16] for f in w['warm'])}")
    lines.append(f"jobs ({summary.get('jobs', len(status.get('jobs', [])))})")
    lines.append(f"  {'job':<16} {'name':<16} {'consumers':>9} {'workers':>7} {'share':>6} "
                 f"{'wanted':>6} {'starved':>7} {'elements':>12} {'bytes':>14}  "
                 f"{'fingerprint':<16}")
    for j in status.get("jobs", []):
        name = "(shared)" if j.get("shared") else j["name"] or "-"
        lines.append(f"  {j['job']:<16} {str(name)[:16]:<16} {j['consumers']:>9} "
                     f"{j['workers']:>7} {j.get('share', 0.0):>6.1f} "
                     f"{j.get('desired_workers', 0):>6} {j.get('starvation', 0.0):>7.1%} "
                     f"{j['elements']:>12,} {j['bytes']:>14,}  {j['fingerprint'][:16]:<16}")
        for t in j.get("trainers", []):
            lines.append(f"    trainer {t['consumer']} pid {t['pid']}: lag {t['lag']:,} "
                         f"elements, skipped {t['skipped']:,}")
            if t.get("prefix"):
                lines.append(f"      branch {t['branch']}: shares "
                             f"{' > '.join(t['prefix'])}; own: "
                             f"{' > '.join(t.get('suffix') or ['(none)'])}")
        rounds = j.get("rounds")
        if isinstance(rounds, dict):
            vacant = rounds.get("vacant") or []
            lines.append(f"    coordinated, {rounds['num_consumers']} consumers: epoch "
                         f"{rounds['epoch']}, {rounds['rounds']:,} rounds, "
                         f"{rounds['lost']:,} lost"
                         + (f"; waiting for consumer_index {', '.join(map(str, vacant))}"
                            if vacant else ""))
    more = {name: left.get(name, 0) for name in ("workers", "jobs") if left.get(name)}
    if more:
        lines.append(f"... and {' and '.join(f'{n:,} more {name}' for name, n in more.items())}"
                     f" not shown (zloader status --all, or --from "
                     f"'{json.dumps(status['next'])}')")
    return "\n".join(lines)
