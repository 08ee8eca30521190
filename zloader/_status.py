"""Ask a broker for its status (``zloader status``, ``zloader top``, the actuators)."""

from __future__ import annotations

from typing import Any

import zmq

from zloader.transport import messages
from zloader.transport.keys import Keys
from zloader.transport.protocol import decode, encode
from zloader.transport.sockets import make_socket

__all__ = ["Unanswered", "fetch_status"]


class Unanswered(Exception):
    """The broker did not answer a status request in time."""


def fetch_status(broker: str, keys: Keys | None, timeout: float) -> dict[str, Any]:
    """One STATUS answer from ``broker`` (the dict ``zloader.broker.status.status`` builds).

    Raises:
        Unanswered: none within ``timeout`` seconds, or an answer that is not a status
            (the broker refused the request: another protocol version).
        ProtocolError: the answer is malformed.
    """
    context = zmq.Context()
    sock = make_socket(context, zmq.DEALER, keys)
    try:
        sock.connect(broker)
        status = messages.Status()
        sock.send_multipart(encode(status.COMMAND, messages.encode(status)))
        if not sock.poll(int(timeout * 1000)):
            raise Unanswered(
                f"no answer from {broker} within {timeout:.0f} s (is zloader-broker running "
                "there? does it want --keys, or other keys?)")
        answer = messages.decode(decode(sock.recv_multipart()))
        if isinstance(answer, messages.Error):
            raise Unanswered(f"{broker} refused the status request: {answer.message}")
        if not isinstance(answer, messages.Status):
            raise Unanswered(f"{broker} answered {answer.COMMAND.name}, not STATUS")
        return answer.report
    finally:
        sock.close(0)
        context.term()
