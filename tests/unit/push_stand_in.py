"""A STAND-IN for the dashboard, for the push client's unit tests.

A plain ``http.server`` on loopback that answers with scripted actions and records
every request. It exists so the retry policy can meet exact sequences (503 twice, a
hang, a dropped connection, a redirect) that the real dashboard never produces on
purpose. The real dashboard is exercised in ``tests/dashboard/test_end_to_end.py``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


@dataclass
class StandIn:
    """Scripted answers, consumed in order; the last one repeats."""

    server: ThreadingHTTPServer
    script: list = field(default_factory=lambda: [200])
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def next_action(self):
        with self.lock:
            return self.script.pop(0) if len(self.script) > 1 else self.script[0]


def _handler(stand_in_ref: list) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def _answer(self) -> None:
            stand_in: StandIn = stand_in_ref[0]
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            with stand_in.lock:
                stand_in.seen.append(Seen(self.command, self.path, dict(self.headers), body))
            action = stand_in.next_action()
            if action == "hang":
                time.sleep(1.5)
                action = 200
            if action == "trickle":
                # Headers at once, then a byte every 0.2 s: no single read ever times out.
                self.send_response(200)
                self.send_header("Content-Length", "40")
                self.end_headers()
                for _ in range(40):
                    try:
                        self.wfile.write(b" ")
                        self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        return  # the client gave up, as the test wants it to
                    time.sleep(0.2)
                return
            if action == "drop":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if isinstance(action, tuple) and action[0] == "redirect":
                _, status, location = action
                self.send_response(status)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status, payload = action if isinstance(action, tuple) else (action, None)
            if payload is None:
                payload = {"push_id": len(stand_in.seen)} if status < 300 else {"detail": "no"}
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_PUT = do_POST = do_GET = _answer

    return Handler


def serve() -> Iterator[StandIn]:
    """A stand-in on a free loopback port, shut down when the generator is closed."""
    ref: list = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(ref))
    server.daemon_threads = True
    ref.append(StandIn(server))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield ref[0]
    server.shutdown()
    server.server_close()
    thread.join(5)


def free_port() -> int:
    """A loopback port with nothing listening on it (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
