"""CURVE keys: one directory, made by ``zloader keygen DIR``, serves every role.

``DIR`` (mode 0700) holds two key pairs and the list of keys allowed in::

    server.key, server.key_secret   every bound socket serves with these (the broker's, each
                                    worker's data socket, a Loader's source socket)
    client.key, client.key_secret   every connecting socket presents these
    authorized/                     the public keys allowed to connect (client.key at first;
                                    add a host's own client.key here to let it in)

With keys, every socket of the service speaks CURVE (ZeroMQ RFC 26): traffic is encrypted,
a connecting peer must know the server's public key, and a bound socket lets in only the
clients whose public key is in ``authorized/`` (checked by a ZAP handler in each process).
Copy the directory to every host of the service (broker, workers, trainers); keep it
private: its secret keys let a process in.

CURVE encrypts every frame, which costs throughput on TCP data sockets (see
bench/results/transport.md, section e). On a trusted network a worker may serve its data
socket with ZeroMQ's PLAIN mechanism instead (``zloader-worker --plain-data``): consumers
then prove they hold the keys directory with a token derived from its client secret key, and
the data travels unencrypted (the token too, so anyone who can watch the network can replay
it). The broker socket always speaks CURVE: only it receives code.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import stat
from dataclasses import dataclass
from typing import Any

import zmq

from zloader._byfields import FrozenByFields
from zloader._hash import sha256

__all__ = ["KEYS_ENV", "Keys", "KeysError", "keygen", "resolve", "unsafe_directory"]

log = logging.getLogger("zloader.keys")

KEYS_ENV = "ZLOADER_KEYS"
"""Environment variable naming the keys directory when ``keys=`` / ``--keys`` is not given."""


class KeysError(ValueError):
    """The keys directory is missing, incomplete, or open to or owned by other users."""


def unsafe_directory(path: pathlib.Path, what: str, mask: int = 0o022) -> str | None:
    """Why another local user could swap the files in the directory ``path``, or None.

    The rule ssh applies to ``~/.ssh``: the directory must belong to the user running
    this process, and its mode must grant none of ``mask`` (default: no write permission
    for group or others). The text names the directory, the owner or mode found and the
    command that fixes it.

    Args:
        path: an existing directory (resolved: symbolic links followed).
        what: what the directory is, for the message ("keys directory", "work dir").
        mask: permission bits that make it unsafe.
    """
    info = path.stat()
    me = os.geteuid()
    if info.st_uid != me:
        return (f"{what} {path} belongs to {_user(info.st_uid)}, not to {_user(me)} who runs "
                "this: its owner could replace the files in it; use a directory of your "
                f"own, or `chown {_name(me)} {path}` if you trust it")
    mode = stat.S_IMODE(info.st_mode)
    if mode & mask:
        reach = "open to" if mask & 0o044 else "writable by"
        return (f"{what} {path} is {reach} other users (mode {mode:o}): they could "
                f"replace the files in it; run `chmod 700 {path}`")
    return None


def _name(uid: int) -> str:
    """The user name of ``uid``, or the number when it has none."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _user(uid: int) -> str:
    name = _name(uid)
    return f"uid {uid}" if name == str(uid) else f"uid {uid} ({name})"


@dataclass(eq=False, repr=False)
class Keys(FrozenByFields):
    """The key pairs of a keys directory, and where its authorized keys are."""

    path: str
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def authorized(self) -> str:
        return os.path.join(self.path, "authorized")

    @property
    def token(self) -> bytes:
        """The PLAIN password of ``--plain-data`` sockets, derived from the client secret."""
        return sha256(b"zloader plain data\0" + self.client_secret).hexdigest().encode()

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Keys:
        """Read ``path``; raises :class:`KeysError` naming what is wrong."""
        root = pathlib.Path(path).expanduser().resolve()
        if not root.is_dir():
            raise KeysError(f"keys directory {root} does not exist: create one with "
                            f"`zloader keygen {root}`")
        problem = unsafe_directory(root, "keys directory", mask=0o077)
        if problem is not None:
            raise KeysError(f"{problem} (its secret keys let a process in)")
        import zmq.auth  # (only a process with keys needs it)
        try:
            server = zmq.auth.load_certificate(str(root / "server.key_secret"))
            client = zmq.auth.load_certificate(str(root / "client.key_secret"))
        except (OSError, ValueError) as exc:
            raise KeysError(f"keys directory {root} is incomplete ({exc}); make a new one "
                            f"with `zloader keygen DIR`") from None
        if not (root / "authorized").is_dir():
            raise KeysError(f"keys directory {root} has no authorized/ directory; make a "
                            "new one with `zloader keygen DIR`")
        if server[1] is None or client[1] is None:
            raise KeysError(f"keys directory {root}: server.key_secret or client.key_secret "
                            "holds no secret key")
        return cls(str(root), server[0], server[1], client[0], client[1])

    def serve(self, socket: zmq.Socket[Any]) -> None:
        """Make a socket about to bind a CURVE server (before ``bind``)."""
        socket.curve_secretkey = self.server_secret
        socket.curve_publickey = self.server_public
        socket.curve_server = True

    def connect(self, socket: zmq.Socket[Any]) -> None:
        """Make a socket about to connect a CURVE client (before ``connect``)."""
        socket.curve_secretkey = self.client_secret
        socket.curve_publickey = self.client_public
        socket.curve_serverkey = self.server_public

    def serve_plain(self, socket: zmq.Socket[Any]) -> None:
        """A PLAIN server (``--plain-data``): authenticated by token, not encrypted."""
        socket.plain_server = True

    def connect_plain(self, socket: zmq.Socket[Any]) -> None:
        socket.plain_username = b"zloader"
        socket.plain_password = self.token

    def guard(self, context: zmq.Context[Any]) -> Any:
        """Start the ZAP handler that lets in only authorized clients, for the sockets of
        ``context`` that serve; start it before binding them. Stop it before
        ``context.term()``."""
        # (zmq.auth.thread imports asyncio: only a process that serves with keys needs it)
        from zmq.auth.thread import ThreadAuthenticator

        authenticator = ThreadAuthenticator(context, log=logging.getLogger("zloader.zap"))
        authenticator.start()
        authenticator.configure_curve(domain="*", location=self.authorized)
        authenticator.configure_plain(domain="*", passwords={"zloader": self.token.decode()})
        return authenticator


def resolve(keys: Keys | str | os.PathLike[str] | None) -> Keys | None:
    """``keys`` as :class:`Keys`: a directory path, or None for ``$ZLOADER_KEYS`` (no keys
    when that is unset or empty)."""
    if isinstance(keys, Keys):
        return keys
    if keys is None:
        keys = os.environ.get(KEYS_ENV) or None
        if keys is None:
            return None
    if not isinstance(keys, (str, os.PathLike)):
        raise TypeError(f"keys must be a directory path, got {type(keys).__name__}")
    return Keys.load(keys)


def keygen(path: str | os.PathLike[str]) -> Keys:
    """Create the keys directory ``path`` (mode 0700): server and client key pairs, and
    ``authorized/`` holding the client's public key.

    Raises:
        KeysError: ``path`` exists and is not an empty directory, or is one another user
            owns or may write to.
    """
    root = pathlib.Path(path).expanduser().resolve()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise KeysError(f"{root} exists and is not an empty directory: keygen will not "
                        "overwrite keys")
    problem = unsafe_directory(root, "directory") if root.exists() else None
    if problem is not None:
        raise KeysError(f"{problem}; keygen will not put keys there")
    import zmq.auth
    old_umask = os.umask(0o077)
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        zmq.auth.create_certificates(str(root), "server")
        zmq.auth.create_certificates(str(root), "client")
        (root / "authorized").mkdir(mode=0o700)
        shutil.copy(root / "client.key", root / "authorized" / "client.key")
    finally:
        os.umask(old_umask)
    return Keys.load(root)

