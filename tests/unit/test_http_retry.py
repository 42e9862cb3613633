"""A refused connection to the dashboard is retried once, after a short delay.

A dashboard being restarted refuses connections for a moment; one that nobody runs
refuses for good. The push client therefore tries a refused connection exactly
twice. The "dashboard" here is a minimal ``http.server`` on loopback that starts
listening on a port only after the first attempt was refused (its start is the
client's sleep between attempts), so the test is deterministic and waits for
nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rootstock.ops.http_client import RetryPolicy, request_json
from tests.unit.push_stand_in import free_port

pytestmark = pytest.mark.timeout(30)

# The sleeps are hooks: nothing here waits out a delay, so the default one is used.
POLICY = RetryPolicy(attempt_timeout=2.0, total_cap=8.0, first_delay=1.0)


class _Answer200(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        data = json.dumps({"push_id": 1}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class LateServer:
    """An HTTP server on ``port`` that exists only once :meth:`start` was called."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind, listen and serve on a daemon thread."""
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), _Answer200)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,))
        self.thread.daemon = True
        self.thread.start()

    def close(self) -> None:
        """Stop serving and release the port."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(5)


@pytest.fixture
def late_server() -> Iterator[LateServer]:
    server = LateServer(free_port())
    yield server
    server.close()


def test_a_refused_connection_is_retried_once_after_a_short_delay(late_server):
    slept: list[float] = []

    def sleep_then_listen(seconds: float) -> None:
        slept.append(seconds)
        late_server.start()  # the dashboard comes back while the client waits

    outcome = request_json(
        "PUT", f"http://127.0.0.1:{late_server.port}/x", {"a": 1}, policy=POLICY,
        sleep=sleep_then_listen,
    )  # fmt: skip
    assert outcome.ok and outcome.attempts == 2, outcome
    assert outcome.json() == {"push_id": 1}
    assert slept == [POLICY.refused_delay]


def test_a_second_refusal_is_final(late_server):
    slept: list[float] = []
    started = time.monotonic()
    outcome = request_json(
        "PUT", f"http://127.0.0.1:{late_server.port}/x", {}, policy=POLICY, sleep=slept.append
    )
    assert outcome.status is None and outcome.attempts == 2
    assert "refused" in outcome.error and "after 2 attempts" in outcome.error
    # One short wait, not the exponential backoff up to the 8 s cap.
    assert slept == [POLICY.refused_delay]
    assert time.monotonic() - started < 2.0


def test_the_default_delay_is_short_and_inside_the_cap():
    policy = RetryPolicy()
    assert 0 < policy.refused_delay <= 2.0 < policy.total_cap


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"a": NaN}', b"\xff", b"<html>"])
def test_an_answer_that_is_not_standard_json_reads_as_none(body):
    # A hostile or broken server's deep nesting is "not JSON", never a RecursionError.
    from rootstock.ops.http_client import HttpOutcome

    assert HttpOutcome(status=500, body=body, attempts=1, seconds=0.1).json() is None
