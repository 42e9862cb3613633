"""Benchmark: the coverage dashboard on SQLite with 50 clusters x 300 checkpoints.

Starts the real server (`rootstock dashboard serve --db <tmp>/bench.sqlite`) as a
subprocess on a free loopback port, creates the clusters and one key per cluster
in-process (`rootstock.dashboard.credentials`: 50 CLI processes would take longer than
the rest of the run), then pushes one synthetic manifest per cluster through the API:
10 families (envs) x 30 checkpoints, shaped like `cluster_view` output, mostly
verified with some failed, drifted, stale and fetched-only cells. Then, with one
keep-alive client at a time:

* `GET /` (the coverage page) and `GET /api/v1/coverage`: wall time per request,
  median and p95 over the repeats; target p95 < 300 ms each;
* `PUT /api/v1/clusters/{c}/manifest` from one client (uncontended handling time).

and with 10 client threads, each pushing its own cluster's 300-checkpoint manifest
repeatedly (each push re-verifies a tenth of the checkpoints, as a `smoke-test
--push-every` run does): the server-side handling time of each push, read from the
`app` metric of the `Server-Timing` header the server sets (handling time, after any
wait for the write slot, which the `queue` metric reports); target p95 < 100 ms. The
client-observed time is shown for contrast: 10 clients sharing the machine's cores
with the server mostly measure queueing.

    python benchmarks/dashboard.py [--quick] [--json] [--clusters N] [--checkpoints N]
                                   [--repeat N] [--pushes N] [--keep DIR]

Reports a table; never asserts (these machines are too noisy for that). Exits
non-zero only when the benchmark itself breaks (server does not start, a request
fails, the loaded matrix is not the expected size).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table
from _dashboard_data import FAMILIES, encode, synthetic_manifest

PUSH_CLIENTS = 10
COVERAGE_TARGET_MS = 300.0
PUSH_TARGET_MS = 100.0
START_TIMEOUT = 120.0  # seconds for the pushing clients to connect
SERVER_TIMING = re.compile(r"(?:^|,)\s*app;dur=([0-9.]+)")
QUEUE_TIMING = re.compile(r"(?:^|,)\s*queue;dur=([0-9.]+)")


# --- the server and a keep-alive client ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`rootstock dashboard serve` in its own process group, killed with it."""

    def __init__(self, db: Path, work: Path) -> None:
        self.port = free_port()
        self.log = work / "server.log"
        env = {**os.environ, "ROOTSTOCK_CONFIG": str(work / "config.toml")}
        env.pop("ROOTSTOCK_DASHBOARD_DB", None)
        command = [sys.executable, "-m", "rootstock.cli.main", "dashboard", "serve"]
        command += ["--db", str(db), "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Poll the OpenAPI schema until it answers; raise with the log if the server dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/api/v1/openapi.json")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server did not answer within {timeout:.0f} s:\n{self.tail()}")

    def cpu_seconds(self) -> float | None:
        """User + system CPU time the server has used so far (Linux only, else None).

        Per request, this is the handling cost without any queueing in it, and it
        moves little when other work shares the cores.
        """
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return None
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers."""
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


class NoDelayConnection(http.client.HTTPConnection):
    """HTTPConnection without Nagle's algorithm, so no request waits on a delayed ACK."""

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Client:
    """One keep-alive HTTP/1.1 connection; every request returns (wall s, server ms, body)."""

    def __init__(self, port: int) -> None:
        self.conn = NoDelayConnection("127.0.0.1", port, timeout=120)
        self.last_queue_ms: float | None = None

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> tuple[float, float | None, bytes]:
        """Send one request (reconnecting once if the server closed an idle connection)."""
        for attempt in (0, 1):
            start = time.perf_counter()
            try:
                self.conn.request(method, path, body=body, headers=headers or {})
                response = self.conn.getresponse()
                data = response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                if attempt:
                    raise
                continue
            wall = time.perf_counter() - start
            if response.status != 200:
                raise RuntimeError(f"{method} {path}: HTTP {response.status}: {data[:500]!r}")
            timing = response.getheader("Server-Timing") or ""
            queued = QUEUE_TIMING.search(timing)
            self.last_queue_ms = float(queued.group(1)) if queued else None
            match = SERVER_TIMING.search(timing)
            return wall, float(match.group(1)) if match else None, data
        raise AssertionError("unreachable")

    def push(self, cluster: str, body: bytes, auth: str) -> tuple[float, float | None]:
        """PUT one manifest; (client wall s, server ms)."""
        headers = {"Authorization": auth, "Content-Type": "application/json"}
        wall, server, _ = self.request("PUT", f"/api/v1/clusters/{cluster}/manifest", body, headers)
        return wall, server

    def close(self) -> None:
        self.conn.close()


# --- set-up --------------------------------------------------------------------------------


def create_credentials(db: Path, n_clusters: int) -> dict[str, str]:
    """Migrate the database, add the clusters and one key each: {cluster: Authorization}."""
    from rootstock.dashboard import credentials
    from rootstock.dashboard.db import database_url, make_engine, make_sessionmaker, migrate

    engine = make_engine(database_url(str(db)))
    try:
        migrate(engine)
        sessions = make_sessionmaker(engine)
        auth: dict[str, str] = {}
        with sessions() as session:
            for i in range(n_clusters):
                cluster = f"bench{i:02d}"
                credentials.add_cluster(session, cluster)
                issued = credentials.issue_key(session, [cluster], "bench@example.org")
                auth[cluster] = f"Bearer {issued.key_id}:{issued.secret}"
            session.commit()
        return auth
    finally:
        engine.dispose()


# --- measurements --------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (with few samples, p95 is the slowest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summary(values: list[float | None]) -> dict | None:
    """Median and p95 in ms of ``values`` (None when the server sent no timing)."""
    if not values or any(v is None for v in values):
        return None
    return {
        "n": len(values),
        "median_ms": statistics.median(values),
        "p95_ms": percentile(values, 95),
        "max_ms": max(values),
    }


def load(client: Client, auth: dict[str, str], n_checkpoints: int) -> dict:
    """Push every cluster's first manifest, one after the other."""
    start = time.perf_counter()
    server_ms = []
    for i, cluster in enumerate(auth):
        body = encode(synthetic_manifest(i, n_checkpoints))
        server_ms.append(client.push(cluster, body, auth[cluster])[1])
    return {"seconds": time.perf_counter() - start, "server": summary(server_ms)}


def check_matrix(client: Client, n_clusters: int, n_checkpoints: int) -> None:
    """The benchmark times what it claims: the whole matrix is loaded."""
    _, _, data = client.request("GET", "/api/v1/coverage")
    doc = json.loads(data)
    cells = sum(len(row["cells"]) for row in doc["checkpoints"])
    states = {cell["state"] for row in doc["checkpoints"] for cell in row["cells"].values()}
    if (len(doc["clusters"]), len(doc["checkpoints"])) != (n_clusters, n_checkpoints) or (
        cells != n_clusters * n_checkpoints
    ):
        raise RuntimeError(
            f"coverage shows {len(doc['clusters'])} clusters, {len(doc['checkpoints'])} "
            f"checkpoints and {cells} cells; expected {n_clusters}, {n_checkpoints} and "
            f"{n_clusters * n_checkpoints}"
        )
    expected = {"verified", "failed", "drifted", "stale", "fetched"}
    if n_clusters * n_checkpoints >= 100 and states != expected:
        raise RuntimeError(f"coverage states {sorted(states)}, expected {sorted(expected)}")


def cpu_ms_per_request(server: Server, before: float | None, requests: int) -> float | None:
    after = server.cpu_seconds()
    return None if before is None or after is None else (after - before) * 1000 / requests


def time_reads(server: Server, client: Client, path: str, repeat: int) -> dict:
    """Wall and server time of ``repeat`` GETs of ``path`` after two warm-up requests."""
    for _ in range(2):
        client.request("GET", path)
    walls, servers, size = [], [], 0
    cpu = server.cpu_seconds()
    for _ in range(repeat):
        wall, server_ms, data = client.request("GET", path)
        walls.append(wall * 1000)
        servers.append(server_ms)
        size = len(data)
    return {
        "wall": summary(walls),
        "server": summary(servers),
        "cpu_ms": cpu_ms_per_request(server, cpu, repeat),
        "bytes": size,
    }


def time_pushes(
    server: Server, auth: dict[str, str], n_checkpoints: int, clients: int, rounds: range
) -> dict:
    """``clients`` threads each push their own cluster once per round, all at once.

    Each round's manifest re-verifies a different tenth of the checkpoints, so every
    push carries new history; the bodies are encoded beforehand, so the clients spend
    their CPU time on little but the socket.
    """
    clusters = list(auth)[:clients]
    bodies = {
        cluster: [encode(synthetic_manifest(i, n_checkpoints, r)) for r in rounds]
        for i, cluster in enumerate(clusters)
    }
    walls: list[float] = []
    servers: list[float | None] = []
    queues: list[float | None] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(clusters) + 1)

    def pusher(cluster: str) -> None:
        client = None
        try:
            client = Client(server.port)
            client.request("GET", "/api/v1/clusters")  # connect before the start line
            barrier.wait(START_TIMEOUT)
            for body in bodies[cluster]:
                wall, server_ms = client.push(cluster, body, auth[cluster])
                with lock:
                    walls.append(wall * 1000)
                    servers.append(server_ms)
                    queues.append(client.last_queue_ms)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            barrier.abort()
        finally:
            if client is not None:
                client.close()

    threads = [threading.Thread(target=pusher, args=(c,), daemon=True) for c in clusters]
    for thread in threads:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait(START_TIMEOUT)  # broken when a client failed: its error is raised below
    cpu = server.cpu_seconds()
    start = time.perf_counter()
    for thread in threads:
        thread.join(600)
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"a pushing client failed: {errors[0]!r}") from errors[0]
    if len(walls) != clients * len(rounds):
        raise RuntimeError(f"{len(walls)} of {clients * len(rounds)} pushes finished")
    return {
        "clients": clients,
        "pushes": len(walls),
        "body_bytes": len(bodies[clusters[0]][0]),
        "throughput_per_s": len(walls) / elapsed,
        "wall": summary(walls),
        "server": summary(servers),
        "queue": summary(queues),
        "cpu_ms": cpu_ms_per_request(server, cpu, len(walls)),
    }


# --- report --------------------------------------------------------------------------------


def fmt(stats: dict | None) -> str:
    if stats is None:
        return "n/a (no Server-Timing header)"
    return f"median {stats['median_ms']:.1f} ms, p95 {stats['p95_ms']:.1f} ms (n={stats['n']})"


def verdict(stats: dict | None, limit: float) -> str:
    if stats is None:
        return "?"
    return "yes" if stats["p95_ms"] < limit else "NO"


def cpu(value: float | None) -> str:
    return "n/a (no /proc)" if value is None else f"{value:.1f} ms"


def report(results: dict) -> None:
    size = results["size"]
    load = results["load"]
    rows: list[tuple[str, str, str, str]] = [
        (
            f"load: {size['clusters']} pushes x {size['checkpoints']} checkpoints",
            f"{load['seconds']:.1f} s; Server-Timing {fmt(load['server'])}",
            "",
            "",
        )
    ]
    for label, key in (("GET /", "page"), ("GET /api/v1/coverage", "coverage")):
        read = results[key]
        rows += [
            (
                f"{label} ({read['bytes'] / 1024:.0f} KiB), client wall",
                fmt(read["wall"]),
                f"p95 < {COVERAGE_TARGET_MS:.0f} ms",
                verdict(read["wall"], COVERAGE_TARGET_MS),
            ),
            ("  server, Server-Timing", fmt(read["server"]), "", ""),
            ("  server CPU per request", cpu(read["cpu_ms"]), "", ""),
        ]
    single, many = results["push_1"], results["push_10"]
    kib = many["body_bytes"] / 1024
    rows += [
        (f"PUT manifest ({kib:.0f} KiB), 1 client, Server-Timing", fmt(single["server"]), "", ""),
        ("  client wall", fmt(single["wall"]), "", ""),
        ("  server CPU per push", cpu(single["cpu_ms"]), "", ""),
        (
            f"PUT manifest, {many['clients']} clients, Server-Timing",
            fmt(many["server"]),
            f"p95 < {PUSH_TARGET_MS:.0f} ms",
            verdict(many["server"], PUSH_TARGET_MS),
        ),
        ("  wait for the write slot (Server-Timing queue)", fmt(many["queue"]), "", ""),
        ("  client wall", fmt(many["wall"]), "", "(queueing)"),
        ("  server CPU per push", cpu(many["cpu_ms"]), "", ""),
        (
            "PUT throughput, 1 / 10 clients",
            f"{single['throughput_per_s']:.1f} / {many['throughput_per_s']:.1f} pushes/s",
            "",
            "",
        ),
    ]
    machine = results["machine"]
    print_table(
        f"dashboard benchmark (SQLite {machine['sqlite']}, {size['clusters']} clusters x "
        f"{size['checkpoints']} checkpoints, {machine['cores']} cores, load average "
        f"{machine['load_average']:.1f} at start, Python {machine['python']}"
        f"{', quick' if results['quick'] else ''})",
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and pushes (CI)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument("--clusters", type=int, default=50)
    parser.add_argument("--checkpoints", type=int, default=300)
    parser.add_argument("--repeat", type=int, help="GETs per page (default 30; quick 5)")
    parser.add_argument("--pushes", type=int, help="pushes per client (default 20; quick 4)")
    parser.add_argument("--keep", type=Path, help="keep the database and server log here")
    args = parser.parse_args()
    # A SIGTERM (timeout(1), a CI runner) must still run the teardown that kills the server.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.clusters < PUSH_CLIENTS or args.checkpoints < len(FAMILIES):
        parser.error(f"need at least {PUSH_CLIENTS} clusters and {len(FAMILIES)} checkpoints")
    repeat = args.repeat or (5 if args.quick else 30)
    pushes = args.pushes or (4 if args.quick else 20)

    work = Path(tempfile.mkdtemp(prefix="rootstock-bench-dashboard-"))
    db = work / "bench.sqlite"
    server = None
    results: dict = {
        "quick": args.quick,
        "size": {"clusters": args.clusters, "checkpoints": args.checkpoints},
        "machine": {
            "cores": os.cpu_count(),
            # Other work on the machine shows in every number; say how busy it was.
            "load_average": os.getloadavg()[0],
            "platform": platform.platform(),
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
        },
    }
    try:
        auth = create_credentials(db, args.clusters)
        server = Server(db, work)
        server.wait_ready()
        client = Client(server.port)
        results["load"] = load(client, auth, args.checkpoints)
        check_matrix(client, args.clusters, args.checkpoints)
        results["page"] = time_reads(server, client, "/", repeat)
        results["coverage"] = time_reads(server, client, "/api/v1/coverage", repeat)
        # Rounds 1.. for the lone client, later ones for the ten: every push is new.
        alone, together = range(1, pushes + 1), range(pushes + 1, 2 * pushes + 1)
        results["push_1"] = time_pushes(server, auth, args.checkpoints, 1, alone)
        results["push_10"] = time_pushes(server, auth, args.checkpoints, PUSH_CLIENTS, together)
        client.close()
    except Exception:
        if server is not None:
            print(f"server log (tail):\n{server.tail()}", file=sys.stderr)
        raise
    finally:
        if server is not None:
            server.stop()
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            for name in ("bench.sqlite", "server.log"):
                if (work / name).exists():
                    shutil.copy2(work / name, args.keep / name)
        shutil.rmtree(work, ignore_errors=True)

    if args.json:
        print(json.dumps(results, indent=2))
        return
    report(results)


if __name__ == "__main__":
    main()
