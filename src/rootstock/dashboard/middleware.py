"""The guard in front of every request: credentials, body limit and timing.

A pure ASGI middleware, so that it runs before anything reads the body:

1. a write (any method but GET, HEAD and OPTIONS under ``/api/``) must carry a
   valid, unrevoked key: otherwise ``401`` at once, whatever the body and
   whether or not the cluster exists; a key not scoped to the path's cluster
   gets ``403``;
2. a body over the limit gets ``413``: by its ``Content-Length`` before reading,
   or by counting the bytes of a chunked body as they arrive;
   after any such early answer the rest of the body is read and dropped, up to
   twice the limit and :data:`DRAIN_TIMEOUT_S` (see :meth:`Refusal.send`), so that a
   client still sending reads the answer instead of a connection reset;
3. writes are handled one at a time (a write slot per server process), after
   their body has arrived, so a slow uploader never holds the slot; one Python
   process runs one thread at a time anyway, and SQLite has one writer;
4. every response carries ``Server-Timing: queue;dur=<ms>, app;dur=<ms>``:
   ``app`` is the handling time, from taking the write slot (or, for a read, from
   arrival) to the response headers; ``queue`` is the wait for the slot. With many
   concurrent pushes ``queue`` grows and ``app`` does not (the benchmark reads both).

The authenticated key's row id, a write's body and the time its handling started
are left in ``scope["state"]`` for the handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from rootstock.dashboard import credentials
from rootstock.names import is_cluster_name

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# How long a refused request's unread body is drained after the answer: enough for
# megabytes on any network a push crosses, short enough that a client promising a
# body it never sends holds nothing for long.
DRAIN_TIMEOUT_S = 10.0
CLUSTER_PATH = re.compile(r"^/api/v\d+/clusters/([^/]+)/")
log = logging.getLogger("rootstock.dashboard")


class BodyTooLarge(Exception):
    """The request body went over the limit while it was being read."""

    def __init__(self, more_body: bool) -> None:
        super().__init__("the request body is over the limit")
        self.more_body = more_body  # False: the body has all arrived, nothing to drain


class GuardMiddleware:
    """Authenticate writes before their body is read; cap bodies; time responses."""

    def __init__(self, app: ASGIApp, sessions: sessionmaker[Session], max_body: int) -> None:
        self.app = app
        self.sessions = sessions
        self.max_body = max_body
        # A refused body of any size a write may have is drained whole, and a 413's
        # up to twice the limit past the answer; beyond that the client's own watch
        # for an early answer (rootstock.ops.http_client) has to do.
        self.drain_limit = 2 * max_body
        self.write_slot = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        timing = Timing(time.perf_counter())
        state = scope.setdefault("state", {})
        state["rootstock_started"] = timing.started
        send = timing.wrap(send)

        method = scope["method"].upper()
        is_write = method not in SAFE_METHODS and scope["path"].startswith("/api/")
        if is_write:
            refusal = await run_in_threadpool(self._check_credentials, scope)
            if refusal is not None:
                await refusal.send(send, receive, self.drain_limit)
                return

        declared = _content_length(scope)
        if declared == -1:
            await Refusal(400, "the Content-Length header is not a number").send(send)
            return
        if declared is not None and declared > self.max_body:
            await self._too_large(send, receive)
            return
        if not is_write:
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(receive)
        except BodyTooLarge as exc:
            await self._too_large(send, receive if exc.more_body else None)
            return
        # Kept for the handler: a manifest's history row stores the body as received.
        state["rootstock_body"] = body
        async with self.write_slot:
            timing.start_handling()
            state["rootstock_started"] = timing.started
            await self.app(scope, _replay(body, receive), send)

    def _check_credentials(self, scope: Scope) -> Refusal | None:
        """The refusal for this write's credentials and cluster, or None (runs in a thread)."""
        header = _header(scope, b"authorization")
        match = CLUSTER_PATH.match(scope["path"])
        try:
            with self.sessions() as session:
                key = credentials.authenticate(session, header)
                cluster = match.group(1) if match else None
                # No key can be scoped to a name that could never be added (a NUL in it
                # would even make PostgreSQL refuse the query): refused without asking.
                if cluster is not None and not (
                    is_cluster_name(cluster) and credentials.may_write(session, key, cluster)
                ):
                    return Refusal(403, f"this API key may not write to cluster {cluster!r}")
                scope["state"]["rootstock_api_key_id"] = key.id
        except credentials.AuthenticationFailed as exc:
            return Refusal(401, exc.message, {"www-authenticate": "Bearer"})
        except SQLAlchemyError as exc:
            log.error(
                "database error checking credentials on %s: %s",
                scope["path"],
                getattr(exc, "orig", exc),
            )
            return Refusal(503, "the dashboard database is unavailable; retry later")
        return None

    async def _read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                # The rest, if any, is drained after the 413 is on its way.
                raise BodyTooLarge(message.get("more_body", False))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def _too_large(self, send: Send, receive: Receive | None) -> None:
        refusal = Refusal(413, f"the request body is over the limit of {self.max_body} bytes")
        await refusal.send(send, receive, self.drain_limit)


class Refusal:
    """A JSON error answered by the middleware itself."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.detail = detail
        self.headers = headers or {}

    async def send(self, send: Send, receive: Receive | None = None, drain_limit: int = 0) -> None:
        """Answer with this refusal, then close the connection.

        With ``receive``, the request's unread body is drained between the answer's
        bytes and the end of the response (at most ``drain_limit`` bytes and
        :data:`DRAIN_TIMEOUT_S`). Closing a socket with unread input makes the
        kernel send a reset instead of a clean close, and a client still sending
        a large body would then report "connection reset" instead of this answer.
        The ASGI server ends the connection when the response ends, so the drain
        must come before the final (empty) body message; the answer itself has
        already been written by then, so nothing waits for the drain.
        """
        body = json.dumps({"detail": self.detail}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *((k.encode(), v.encode()) for k, v in self.headers.items()),
        ]
        if self.status == 503:
            headers.append((b"retry-after", b"5"))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        if receive is None:
            await send({"type": "http.response.body", "body": body})
            return
        await send({"type": "http.response.body", "body": body, "more_body": True})
        # A client that sends no more in time has had the answer for that long.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_drain(receive, drain_limit), DRAIN_TIMEOUT_S)
        await send({"type": "http.response.body", "body": b""})


class Timing:
    """When a request arrived, and when its handling started (after any queueing)."""

    def __init__(self, arrived: float) -> None:
        self.arrived = arrived
        self.started = arrived
        self.queued_ms = 0.0

    def start_handling(self) -> None:
        """Mark the end of the wait for the write slot."""
        now = time.perf_counter()
        self.queued_ms += (now - self.started) * 1000
        self.started = now

    def wrap(self, send: Send) -> Send:
        """``send`` with a ``Server-Timing`` header added to the response start."""

        async def send_with_timing(message: Message) -> None:
            if message["type"] == "http.response.start":
                handled_ms = (time.perf_counter() - self.started) * 1000
                value = f"queue;dur={self.queued_ms:.2f}, app;dur={handled_ms:.2f}"
                headers = [*message.get("headers", []), (b"server-timing", value.encode())]
                message = {**message, "headers": headers}
            await send(message)

        return send_with_timing


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _drain(receive: Receive, limit: int) -> None:
    """Read and drop request body messages until the body ends or ``limit`` bytes."""
    drained = 0
    while drained <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _content_length(scope: Scope) -> int | None:
    """The declared body length; None when absent, -1 when not a number."""
    text = _header(scope, b"content-length")
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else -1
