"""Where and how kestrel serve listens: the bind check (loopback, unless an API key guards the server), the socket,
and uvicorn with kestrel's signals: SIGINT, SIGTERM or SIGHUP stops admitting, lets what runs finish within the
grace period (then cuts it, each stream still ending with its last chunk and ``[DONE]``), and returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
import threading
from typing import Callable

import uvicorn

from ..errors import ConfigError
from ..signals import SIGNALS

log = logging.getLogger("kestrel.serve")


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise ConfigError(f"--host {host!r} does not resolve to an address; give an IP address or a known "
                          "name") from None
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_bind(host: str, api_key: str | None, allow_insecure: bool) -> None:
    """Refuse to serve an open API beyond this machine, unless asked to."""
    if api_key or allow_insecure or is_loopback(host):
        return
    raise ConfigError(f"--host {host} is reachable from other machines, and no API key is set: set one with "
                      "KESTREL_API_KEY (or --api-key), or pass --allow-insecure to serve without one")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket: bound before the model loads, so that a port in use fails at once, and clients that
    connect early wait in the backlog."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (socket.gaierror, UnicodeError, OSError) as exc:
        raise ConfigError(f"--host {host!r}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --port, or stop "
                          "what holds it") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


if not hasattr(uvicorn.Server, "capture_signals"):  # before 0.29 uvicorn set its handlers another way
    raise ConfigError(f"kestrel serve needs uvicorn 0.29 or later (this is {uvicorn.__version__}): "
                      "pip install -U uvicorn")


class Server(uvicorn.Server):
    """uvicorn, whose signal handlers call ``on_stop(signum)`` on the loop (once; a second signal calls
    ``on_force()``) and which, unlike uvicorn's own, do not raise the signal again once the server has stopped: the
    command exits 0."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[int], None], on_force: Callable[[], None]):
        super().__init__(config)
        self.on_stop, self.on_force = on_stop, on_force
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self._signalled) for s in SIGNALS}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)

    def _signalled(self, signum, frame) -> None:
        # A signal handler runs between two bytecodes of the loop's thread: hand the work to the loop.
        call = self.on_force if self.should_exit else (lambda: self.on_stop(signum))
        self.should_exit = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(call)
