"""Who may reach kestrel serve from a browser: the Host a request names, the media type of its body, and CORS.

A keyless server on loopback answers only loopback Host names (``localhost``, ``127.0.0.1``, ``[::1]``, any port), so
a page whose name an attacker points at 127.0.0.1 (DNS rebinding) cannot use it; ``--allowed-hosts`` adds names
(``*``: any). A server bound elsewhere (behind its key, or with ``--allow-insecure``) answers any Host unless
``--allowed-hosts`` names them. A body must be ``application/json``: a page can POST ``text/plain`` to any site
without a CORS preflight, and JSON needs one. No CORS header is sent unless ``--allowed-origins`` names origins
(``*``: any); then those origins get them, preflights included. Every refusal is OpenAI's error object.
"""

from __future__ import annotations

import json

from kestrel_core.serve.protocol import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"


def host_name(host: str) -> str:
    """A Host header's name without its port, lower-cased (``[::1]:8000`` -> ``[::1]``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def parse_list(value: str | None, flag: str) -> frozenset[str] | None:
    """A comma-separated flag as a set (None where the flag was not given); an empty one is a one-line error."""
    from kestrel_core.errors import ConfigError

    if value is None:
        return None
    items = frozenset(v.strip().lower() for v in value.split(",") if v.strip())
    if not items:
        raise ConfigError(f"{flag} is empty; name at least one (or '*' for any), or leave the flag out")
    return items


def allowed_hosts(given: frozenset[str] | None, loopback: bool) -> frozenset[str] | None:
    """The Host names a server answers: on loopback, the loopback names and ``given``; bound elsewhere, ``given``
    (None: any)."""
    if loopback:
        return LOOPBACK_NAMES | (given or frozenset())
    return given


class OriginGuard:
    """ASGI middleware: the Host check, the JSON check on bodies, and CORS where origins are allowed."""

    def __init__(self, app, hosts: frozenset[str] | None, origins: frozenset[str] | None):
        self.app, self.hosts, self.origins = app, hosts, origins  # hosts None: any

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = host_name(headers.get("host", ""))
        if self.hosts is not None and "*" not in self.hosts and host not in self.hosts:
            return await _refuse(send, 403, f"this server answers Host names {', '.join(sorted(self.hosts))}, not "
                                 f"{host or 'none'!r}: reach it by one of those, or name the host with --allowed-hosts",
                                 "host_not_allowed")
        origin = headers.get("origin")
        allowed = origin is not None and self.origins is not None and ("*" in self.origins or origin.lower() in self.origins)
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")] if allowed else []
        if scope["method"] == "OPTIONS" and allowed and "access-control-request-method" in headers:
            return await _answer(send, 204, b"", cors + [(b"access-control-allow-methods", CORS_METHODS.encode()),
                                                          (b"access-control-allow-headers", CORS_HEADERS.encode()),
                                                          (b"access-control-max-age", b"600")])
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return await _refuse(send, 415, f"the body must be JSON, sent as Content-Type: application/json (got "
                                     f"{media or 'none'!r})", "unsupported_media_type", cors)
        if not cors:
            return await self.app(scope, receive, send)

        async def with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        return await self.app(scope, receive, with_cors)


async def _refuse(send, status: int, message: str, code: str, extra=()) -> None:
    body = json.dumps(APIError(status, message, code=code).body()).encode()
    await _answer(send, status, body, [(b"content-type", b"application/json"), *extra])


async def _answer(send, status: int, body: bytes, headers) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})
