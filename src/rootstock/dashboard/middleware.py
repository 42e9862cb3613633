"""The guard in front of every request: credentials, body limit and timing.

A pure ASGI middleware, so that it runs before anything reads the body:

1. a write (any method but GET, HEAD and OPTIONS under ``/api/``) must carry a
   valid, unrevoked key: otherwise ``401`` at once, whatever the body and
   whether or not the cluster exists; a key not scoped to the path's cluster
   gets ``403``;
2. a body over the limit gets ``413``: by its ``Content-Length`` before reading,
   or by counting the bytes of a chunked body as they arrive;
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

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CLUSTER_PATH = re.compile(r"^/api/v\d+/clusters/([^/]+)/")
log = logging.getLogger("rootstock.dashboard")


class BodyTooLarge(Exception):
    """The request body went over the limit while it was being read."""


class GuardMiddleware:
    """Authenticate writes before their body is read; cap bodies; time responses."""

    def __init__(self, app: ASGIApp, sessions: sessionmaker[Session], max_body: int) -> None:
        self.app = app
        self.sessions = sessions
        self.max_body = max_body
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
                await refusal.send(send)
                return

        declared = _content_length(scope)
        if declared == -1:
            await Refusal(400, "the Content-Length header is not a number").send(send)
            return
        if declared is not None and declared > self.max_body:
            await self._too_large(send)
            return
        if not is_write:
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(receive)
        except BodyTooLarge:
            await self._too_large(send)
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
                    credentials.CLUSTER_NAME_PATTERN.fullmatch(cluster)
                    and credentials.may_write(session, key, cluster)
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
                if message.get("more_body", False):
                    # Read (and drop) up to as much again, so that a client still sending
                    # sees the 413 instead of a connection reset; past that, stop reading.
                    await _drain(receive, self.max_body)
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def _too_large(self, send: Send) -> None:
        await Refusal(413, f"the request body is over the limit of {self.max_body} bytes").send(
            send
        )


class Refusal:
    """A JSON error answered by the middleware itself."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.detail = detail
        self.headers = headers or {}

    async def send(self, send: Send) -> None:
        """Answer with this refusal, and close the connection (the body may be unread)."""
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
        await send({"type": "http.response.body", "body": body})


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
