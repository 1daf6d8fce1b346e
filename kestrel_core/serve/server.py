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

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kestrel_core.errors import ConfigError
from kestrel_core.io.signals import SIGNALS

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


HEADER_TIMEOUT_S = 30.0  # a request's headers must all arrive within this of the connection, or of the last answer


def header_deadline(seconds: float = HEADER_TIMEOUT_S) -> type:
    """uvicorn's h11 protocol, closing a connection whose request headers have not all come within ``seconds`` of
    the connection or of its last answer. uvicorn has no such timeout: a client that connects and sends nothing, or
    its headers a byte a minute, would hold a connection for ever (the body has its own, in ``app.py``)."""

    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc) -> None:
            self._cancel()
            super().connection_lost(exc)

        def _watch(self) -> None:
            """Arm the deadline while the next request's headers are awaited (h11's IDLE); disarm it once they came."""
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                self._cancel()
            elif self._deadline is None:
                self._deadline = self.loop.call_later(seconds, self._late)

        def _cancel(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closed a connection from %s whose request headers did not all come within %g s",
                         "%s:%d" % self.client if self.client else "a client", seconds)
                self.transport.close()

    return HeaderDeadline


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
