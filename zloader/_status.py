"""Ask a broker for its status (``zloader status``, ``zloader top``, the actuators).

A STATUS reply is bounded (``zloader.broker.status.status``): the broker's summary, then
as many workers and jobs as fit in one message, and ``next``, where the next page starts.
:func:`fetch_page` asks for one page; :func:`fetch_status` follows ``next`` and returns
every worker and job.
"""

from __future__ import annotations

from typing import Any

import zmq

from zloader.transport import messages
from zloader.transport.keys import Keys
from zloader.transport.protocol import ProtocolError, decode, encode
from zloader.transport.sockets import make_socket

__all__ = ["Unanswered", "fetch_page", "fetch_status"]


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
