"""What the HTTP side of `paradiff serve` refuses before it reads a body, and what it never sends back.

- `Host` (when bound to loopback): a page on another site that rebinds its name to 127.0.0.1 (DNS rebinding)
  sends its own name as Host; only localhost / 127.0.0.1 / [::1] with the server's port, and `--allow-host` names,
  are served.
- `Origin`: a browser names the page that sent a request; another site's page is refused unless `--allow-origin`
  names it (a page of the server itself, /docs, has the server's own origin).
- `Content-Type`: a JSON endpoint takes `application/json` only, so a page cannot send a "simple" cross-site request
  (text/plain, form data) that skips the browser's CORS preflight. The edits endpoint takes `multipart/form-data`
  (OpenAI's), and POST /v1/videos takes it besides JSON, as OpenAI's client sends it; a browser sends `Origin` with any cross-site POST, so the Origin check refuses another site's form.
- Read timeouts: a connection that has not sent its request headers within `--read-timeout` seconds is closed
  (uvicorn only times out idle keep-alive connections), and a body not read within it gets 408.
- An internal error's message (paths, source lines) goes to the server's console, and a short form to the client.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from paradiff.serve.protocol import RequestError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
JSON_ENDPOINTS = ("/v1/images/generations", "/v1/videos")
FORM_ENDPOINTS = ("/v1/images/edits", "/v1/videos")  # multipart/form-data, as OpenAI's (and its client's)
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.@+-]+){2,}[\\/]?")


class RequestGuard:
    """The header checks, from the server's flags."""

    def __init__(self, host: str, port: int, allow_hosts: list[str] | None, allow_origins: list[str] | None) -> None:
        self.port = port
        self.allow_origins = {origin.rstrip("/").lower() for origin in allow_origins or ()}
        self.check_host = host in LOOPBACK_HOSTS
        names = {name.lower() for name in LOOPBACK_NAMES} | {name.lower() for name in allow_hosts or ()}
        # a Host header is NAME or NAME:PORT; an --allow-host given with a port matches only that port
        self.hosts = names | {f"{name}:{port}" for name in names if not _has_port(name)}

    def check_sender(self, headers: dict[str, str]) -> None:
        """RequestError (403) for a request from a foreign Host or Origin; None for one that may be served."""
        host = headers.get("host", "").lower()
        if self.check_host and host not in self.hosts:
            raise RequestError(403, f"Host {host!r} is not served: this server answers on "
                                    f"localhost:{self.port}, 127.0.0.1:{self.port} and [::1]:{self.port} "
                                    "(another name: --allow-host NAME)")
        origin = headers.get("origin")
        if origin is not None and not self._same_origin(origin, host) \
                and origin.rstrip("/").lower() not in self.allow_origins:
            raise RequestError(403, f"Origin {origin!r} is not allowed: a page of another site may not use this "
                                    "server (allow it with --allow-origin ORIGIN)")

    @staticmethod
    def check_body(method: str, path: str, headers: dict[str, str]) -> None:
        """RequestError (415) for a body a JSON (or form) endpoint does not take."""
        if method == "POST" and (path in JSON_ENDPOINTS or path in FORM_ENDPOINTS):
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            takes = [t for t, paths in (("application/json", JSON_ENDPOINTS), ("multipart/form-data", FORM_ENDPOINTS))
                     if path in paths]
            if kind not in takes:
                raise RequestError(415, f"Content-Type {kind or 'missing'!r}: {path} takes "
                                        f"{' or '.join(repr(t) for t in takes)}")

    @staticmethod
    def _same_origin(origin: str, host: str) -> bool:
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and bool(host) and parts.netloc.lower() == host

    def allows_origin(self, origin: str) -> bool:
        return origin.rstrip("/").lower() in self.allow_origins


def _has_port(name: str) -> bool:
    return bool(re.fullmatch(r".*:\d+", name)) and not name.endswith("]")


def public_message(cause: str, limit: int = 300) -> str:
    """What a client is told of an internal error: file paths shortened to their last part, one line, bounded (the
    whole text goes to the server's console)."""
    first = cause.strip().splitlines()[0] if cause.strip() else "internal error"
    short = _PATH.sub(lambda match: ".../" + re.split(r"[\\/]", match.group(0).rstrip("/\\"))[-1], first)
    return short if len(short) <= limit else short[: limit - 3] + "..."


def timed_h11_protocol(read_timeout_s: float):
    """uvicorn's h11 protocol, closing a connection whose request headers take longer than `read_timeout_s` (from
    the connection, or from the previous answer on a kept-alive one)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self._header_timer is not None:
                self._header_timer.cancel()  # the headers are in: the app times the body
                self._header_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(read_timeout_s, self._headers_too_slow)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return TimedH11Protocol
