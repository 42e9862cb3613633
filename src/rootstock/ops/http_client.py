"""JSON over HTTP for dashboard pushes: stdlib only, and bounded in time.

A push runs at the end of ``install``, ``add`` and ``smoke-test``, often inside a
batch job, so a dashboard that is down must cost seconds, not the job's wall time:

* every attempt has its own timeout (``attempt_timeout``);
* timeouts, dropped connections, 5xx and 429 are retried with exponential backoff
  and jitter, but never past ``total_cap`` seconds from the first attempt (one
  :class:`Deadline` can be shared by several requests);
* a refused connection is retried once, after ``refused_delay`` (a dashboard being
  restarted refuses for a moment); a second refusal is final;
* an unknown host, an unreachable network or a bad certificate fails at once:
  waiting will not change that within a push;
* the body is sent in pieces, and an answer that arrives before it is all sent
  (the dashboard refuses a bad key or an oversized body before reading it) ends the
  sending and is read as the answer, so a large push reports "401" or "413" rather
  than the connection reset that would follow;
* any other 4xx is the caller's to explain and is never retried;
* redirects are never followed: a 3xx is a final answer whose ``Location`` the
  caller reports. Following one would resend the credential (urllib keeps the
  ``Authorization`` header) to wherever the answer points, and a POST turned GET
  that lands on some page would pass for a successful push.

``ROOTSTOCK_PUSH_TIMEOUT`` / ``ROOTSTOCK_PUSH_RETRY_CAP`` (or ``push_timeout`` /
``push_retry_cap`` in config.toml) override the two limits.
"""

from __future__ import annotations

import errno
import http.client
import json
import random
import select
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, NamedTuple

from rootstock.errors import ConfigError
from rootstock.install.parsing import loads_json

TIMEOUT_ENV = "ROOTSTOCK_PUSH_TIMEOUT"
RETRY_CAP_ENV = "ROOTSTOCK_PUSH_RETRY_CAP"
MAX_RESPONSE_BYTES = 1 << 20
_GRACE_S = 0.5
# Errors that mean "no route there": retrying inside one push cannot help.
_UNREACHABLE_ERRNOS = {errno.EHOSTUNREACH, errno.ENETUNREACH}
# The body goes out in pieces this large, with a look for an early answer between.
SEND_PIECE_BYTES = 64 * 1024


@dataclass(frozen=True)
class RetryPolicy:
    """How long one push may take: per attempt, in total, and the backoff between."""

    attempt_timeout: float = 10.0
    total_cap: float = 30.0
    first_delay: float = 0.5
    max_delay: float = 8.0
    refused_delay: float = 1.0  # before the one retry of a refused connection

    @classmethod
    def from_settings(
        cls, config: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> RetryPolicy:
        """The default policy, with limits from the environment, then config.toml."""
        config = config or {}
        environ = environ if environ is not None else {}
        timeout = _seconds(environ.get(TIMEOUT_ENV), TIMEOUT_ENV)
        cap = _seconds(environ.get(RETRY_CAP_ENV), RETRY_CAP_ENV)
        if timeout is None:
            timeout = _seconds(config.get("push_timeout"), "push_timeout in config.toml")
        if cap is None:
            cap = _seconds(config.get("push_retry_cap"), "push_retry_cap in config.toml")
        return cls(
            attempt_timeout=timeout if timeout is not None else cls.attempt_timeout,
            total_cap=cap if cap is not None else cls.total_cap,
        )

    def backoff(self, retry: int, rng: Callable[[], float] = random.random) -> float:
        """Seconds to wait before retry number ``retry`` (1-based): doubling, half jittered.

        The jitter keeps many nodes of one job from retrying in lockstep.
        """
        ceiling = min(self.max_delay, self.first_delay * 2 ** (retry - 1))
        return ceiling * (0.5 + 0.5 * rng())


def _seconds(value: Any, name: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if seconds <= 0:
        raise ConfigError(
            f"{name} must be a positive number of seconds, not {value!r}",
            hint=f"fix or remove {name}",
        )
    return seconds


class Deadline:
    """A point on the monotonic clock that several requests share."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.at = clock() + seconds

    def remaining(self) -> float:
        """Seconds left (never negative)."""
        return max(0.0, self.at - self._clock())


@dataclass(frozen=True)
class HttpOutcome:
    """The end of one request: an HTTP answer (``status``) or a transport ``error``."""

    status: int | None
    body: bytes
    attempts: int
    seconds: float
    error: str | None = None
    location: str | None = None  # a redirect's target (absolute), never followed

    @property
    def ok(self) -> bool:
        """True for a 2xx answer; a redirect, an error status or no answer is a failure."""
        return self.status is not None and 200 <= self.status < 300

    def json(self) -> Any:
        """The body as JSON, or None when it is not JSON."""
        try:
            return loads_json(self.body)  # a hostile server's deep JSON is "not JSON" too
        except ValueError:
            return None


def should_retry_status(status: int) -> bool:
    """5xx and 429 may pass; every other answer is final."""
    return status == 429 or status >= 500


def request_json(
    method: str,
    url: str,
    payload: Any,
    *,
    headers: Mapping[str, str] | None = None,
    policy: RetryPolicy | None = None,
    deadline: Deadline | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> HttpOutcome:
    """Send ``payload`` as JSON with ``method`` to ``url`` under the retry policy.

    Never raises for network trouble or HTTP errors: the outcome says what happened
    (``status`` None means no HTTP answer arrived; ``error`` says why).
    """
    policy = policy or RetryPolicy()
    deadline = deadline or Deadline(policy.total_cap)
    started = time.monotonic()
    body = json.dumps(payload, separators=(",", ":")).encode("utf-8")
    attempts = refusals = 0
    last = Attempt(None, b"", "not sent: the retry cap was already spent", False, None, None)
    while True:
        remaining = deadline.remaining()
        if remaining <= 0:
            break
        attempts += 1
        last = _bounded_attempt(
            method, url, body, headers or {}, min(policy.attempt_timeout, remaining)
        )
        if last.refused:
            # A dashboard being restarted refuses for a moment; one nobody runs keeps
            # refusing, and a second refusal is not worth waiting out the cap for.
            refusals += 1
            if refusals > 1:
                break
            wait = policy.refused_delay
        elif last.retry:
            wait = max(policy.backoff(attempts), last.retry_after or 0.0)
        else:
            break
        if wait >= deadline.remaining():
            # The next attempt could not start inside the cap: give up now rather
            # than sleep into it.
            break
        sleep(wait)
    status, data, error, location = last.status, last.body, last.error, last.location
    if error and attempts > 1:
        error = f"{error} (after {attempts} attempts in {time.monotonic() - started:.1f} s)"
    return HttpOutcome(status, data, attempts, time.monotonic() - started, error, location)


class Attempt(NamedTuple):
    """The end of one attempt, and whether (and when) another may follow."""

    status: int | None
    body: bytes
    error: str | None  # a transport error: no HTTP answer arrived
    retry: bool
    retry_after: float | None  # the answer's Retry-After, in seconds
    location: str | None  # a redirect's target, made absolute
    refused: bool = False  # the connection was refused: worth exactly one retry


def _bounded_attempt(
    method: str, url: str, body: bytes, headers: Mapping[str, str], timeout: float
) -> Attempt:
    """:func:`_attempt`, abandoned if it overruns ``timeout`` by more than a grace period.

    Socket timeouts bound connecting and each read, but not a name lookup (the
    resolver has its own, often long, retries) nor a server that trickles bytes;
    running the attempt on a daemon thread makes the cap hold whatever hangs.
    """
    box: list[Attempt] = []
    worker = threading.Thread(
        target=lambda: box.append(_attempt(method, url, body, headers, timeout)),
        name="rootstock-http",
        daemon=True,
    )
    worker.start()
    worker.join(timeout + _GRACE_S)
    if box:
        return box[0]
    return _no_answer("timed out waiting for the dashboard", retry=True)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Turns every redirect into an HTTPError carrying the 3xx, so none is followed."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: http.client.HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        """Follow nothing: the 3xx reaches the caller as an ``HTTPError``."""
        return None


if TYPE_CHECKING:
    # Checked as the connection it is mixed into; at runtime a plain mixin, so the
    # MRO of each connection class below stays what http.client expects.
    _MixinBase = http.client.HTTPConnection
else:
    _MixinBase = object


class _EarlyAnswerMixin(_MixinBase):
    """An HTTP connection that sends in pieces and stops once the server has answered.

    A server may answer before reading the body (the dashboard does for a bad key
    or an oversized body) and then close. A client that goes on sending gets a
    reset, and the answer is lost behind "connection failed". Between pieces this
    connection looks for an answer (or a close) waiting on the socket; once there
    is one, or the server has closed, the rest of the body is dropped and
    ``getresponse()`` reads what the server said (the kernel keeps received bytes
    readable after a reset). Over TLS only the second half applies: a readable
    TLS socket may hold a session ticket rather than an answer.
    """

    sock: socket.socket | None
    _answered_early = False

    def send(self, data: Any) -> None:
        """Send ``data`` in pieces, unless the server has answered already."""
        if self._answered_early:
            return
        if not isinstance(data, bytes | bytearray | memoryview):
            super().send(data)
            return
        view = memoryview(data)
        for start in range(0, max(len(view), 1), SEND_PIECE_BYTES):
            if self.sock is not None and _answer_waiting(self.sock):
                self._answered_early = True
                return
            try:
                super().send(view[start : start + SEND_PIECE_BYTES])
            except (BrokenPipeError, ConnectionResetError):
                # Closed while we sent: getresponse() reads its answer if it gave one,
                # and reports the failure if it did not.
                self._answered_early = True
                return


def _answer_waiting(sock: socket.socket) -> bool:
    """True when the server sent something (or closed) on a plain TCP socket."""
    if isinstance(sock, ssl.SSLSocket) or not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


class _EarlyAnswerHTTPConnection(_EarlyAnswerMixin, http.client.HTTPConnection):
    """Plain HTTP with :class:`_EarlyAnswerMixin`."""


class _EarlyAnswerHTTPSConnection(_EarlyAnswerMixin, http.client.HTTPSConnection):
    """HTTPS with :class:`_EarlyAnswerMixin`."""


class _EarlyAnswerHTTPHandler(urllib.request.HTTPHandler):
    """urllib's HTTP handler on :class:`_EarlyAnswerHTTPConnection`."""

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        """Open ``req`` on a connection that reads an early answer."""
        return self.do_open(_EarlyAnswerHTTPConnection, req)


class _EarlyAnswerHTTPSHandler(urllib.request.HTTPSHandler):
    """urllib's HTTPS handler on :class:`_EarlyAnswerHTTPSConnection`."""

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        """Open ``req`` on a connection that reads an early answer (default TLS context)."""
        context = self._context  # type: ignore[attr-defined]  # set by HTTPSHandler.__init__; typeshed omits it
        return self.do_open(_EarlyAnswerHTTPSConnection, req, context=context)


_OPENER = urllib.request.build_opener(
    _NoRedirects, _EarlyAnswerHTTPHandler, _EarlyAnswerHTTPSHandler
)


def _attempt(
    method: str, url: str, body: bytes, headers: Mapping[str, str], timeout: float
) -> Attempt:
    """One request, as an :data:`Attempt`."""
    from rootstock.version import __version__

    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Content-Type", "application/json")
    request.add_header("Accept", "application/json")
    request.add_header("User-Agent", f"rootstock/{__version__}")
    for name, value in headers.items():
        request.add_header(name, value)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return Attempt(
                response.status, response.read(MAX_RESPONSE_BYTES), None, False, None, None
            )
    except urllib.error.HTTPError as exc:
        data = _read_quietly(exc)
        retry = should_retry_status(exc.code)
        location = _location(url, exc.headers) if 300 <= exc.code < 400 else None
        retry_after = _retry_after(exc.headers) if retry else None
        return Attempt(exc.code, data, None, retry, retry_after, location)
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, BaseException):
            return _transport_failure(reason)
        return _no_answer(f"cannot reach the dashboard: {reason}", retry=False)
    except (OSError, http.client.HTTPException) as exc:
        # Raised while reading the answer (reset, timeout, truncated response).
        return _transport_failure(exc)


def _transport_failure(exc: BaseException) -> Attempt:
    if isinstance(exc, ConnectionRefusedError) or (
        isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED
    ):
        error = f"cannot connect ({_describe(exc).lower()})"
        return Attempt(None, b"", error, False, None, None, refused=True)
    if isinstance(exc, OSError) and exc.errno in _UNREACHABLE_ERRNOS:
        return _no_answer(f"cannot connect ({_describe(exc).lower()})", retry=False)
    if isinstance(exc, socket.gaierror):
        return _no_answer(f"cannot resolve the dashboard's host ({_describe(exc)})", retry=False)
    if isinstance(exc, ssl.SSLCertVerificationError):
        return _no_answer(f"TLS certificate rejected ({_describe(exc)})", retry=False)
    if isinstance(exc, TimeoutError | socket.timeout):
        return _no_answer("timed out waiting for the dashboard", retry=True)
    return _no_answer(f"connection failed ({_describe(exc)})", retry=True)


def _no_answer(error: str, retry: bool) -> Attempt:
    return Attempt(None, b"", error, retry, None, None)


def _location(url: str, headers: Any) -> str | None:
    """A redirect's ``Location``, made absolute against the request's URL."""
    value = headers.get("Location") if headers is not None else None
    return urllib.parse.urljoin(url, value.strip()) if value else None


def _describe(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _read_quietly(exc: urllib.error.HTTPError) -> bytes:
    try:
        return exc.read(MAX_RESPONSE_BYTES) or b""
    except (OSError, ValueError, http.client.HTTPException):
        return b""
    finally:
        exc.close()


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the backoff is good enough


def check_base_url(url: str) -> str:
    """``api_url`` without a trailing slash; raises ConfigError when it is no http(s) URL."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"api_url {url!r} is not an http(s) URL",
            hint="set api_url in config.toml to the dashboard's base URL, "
            "e.g. https://dashboard.example.org",
        )
    return url.strip().rstrip("/")
