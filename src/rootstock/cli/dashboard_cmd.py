"""``rootstock dashboard serve | add-cluster | issue-key | revoke-key | keys``.

The dashboard is an optional extra: everything that needs it is imported inside the
commands, and a missing dependency is an error that names the install command. This
module itself is imported only when ``rootstock dashboard`` runs (``cli/main.py``'s
lazy group), and at its top it imports only :mod:`rootstock.dashboard.retention`:
plain constants, with no dependency of the extra, that build ``--keep-bodies``'s
default, range, variable and help when the ``serve`` command is defined.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import socket
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import click

from rootstock.cli.common import console, emit_json, next_step, print_table, table
from rootstock.cli.options import BODY_BYTES, PORT, Count
from rootstock.dashboard.retention import DEFAULT_KEEP_BODIES, KEEP_BODIES_ENV, MAX_KEEP_BODIES
from rootstock.errors import RootstockError

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

F = TypeVar("F", bound=Callable[..., Any])

EXTRA_HINT = "pip install 'rootstock[dashboard]'"


def _db_option(func: F) -> F:
    return click.option(
        "--db",
        envvar="ROOTSTOCK_DASHBOARD_DB",
        metavar="URL",
        help="Database: a SQLite file path or a SQLAlchemy URL (postgresql://...). "
        "Default: $ROOTSTOCK_DASHBOARD_DB, then ~/.local/share/rootstock/dashboard.sqlite3.",
    )(func)


def _require_extra() -> None:
    """Refuse clearly when the [dashboard] extra is not installed."""
    missing = [
        module
        for module in ("fastapi", "uvicorn", "sqlalchemy", "alembic", "jinja2")
        if not _importable(module)
    ]
    if missing:
        raise RootstockError(
            f"the dashboard needs {', '.join(missing)}, which is not installed",
            hint=f"install the dashboard extra: {EXTRA_HINT}",
        )


def _importable(module: str) -> bool:
    # Looked up, not imported: the credential commands need only SQLAlchemy and
    # Alembic, and importing FastAPI would double their start-up time.
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def _migrated_engine(db: str | None) -> Engine:
    """The engine for ``--db``, with the schema brought up to date."""
    _require_extra()
    from rootstock.dashboard.db import database_url, make_engine, migrate

    engine = make_engine(database_url(db))
    migrate(engine)
    return engine


@contextlib.contextmanager
def _transaction(db: str | None) -> Iterator[Session]:
    """A session on ``--db`` in one transaction, committed on success."""
    from sqlalchemy.exc import SQLAlchemyError

    from rootstock.dashboard.db import begin_write, make_sessionmaker, unreachable

    engine = _migrated_engine(db)
    try:
        with make_sessionmaker(engine)() as session:
            # A write transaction from the start: a running server may be writing too.
            begin_write(session)
            yield session
            session.commit()
    except SQLAlchemyError as exc:
        raise unreachable(engine, exc) from None
    finally:
        engine.dispose()


@click.group("dashboard")
def dashboard() -> None:
    """Run the coverage dashboard and manage its clusters and keys (docs/dashboard.md)."""


@dashboard.command("serve")
@_db_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=PORT)
@click.option(
    "--max-body",
    default=16 * 2**20,
    show_default=True,
    type=BODY_BYTES,
    metavar="BYTES",
    help="Largest request body accepted (413 above it).",
)
@click.option(
    "--keep-bodies",
    default=DEFAULT_KEEP_BODIES,
    show_default=True,
    envvar=KEEP_BODIES_ENV,
    type=Count(1, MAX_KEEP_BODIES),
    metavar="N",
    help="Manifest bodies kept per cluster, the newest (older pushes keep their time "
    f"and counts). Default: ${KEEP_BODIES_ENV}, then {DEFAULT_KEEP_BODIES}.",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
)
def serve(
    db: str | None, host: str, port: int, max_body: int, keep_bodies: int, log_level: str
) -> None:
    """Serve the dashboard (pages and the /api/v1 JSON API) until interrupted.

    Migrates the database to the current schema first. Listens on loopback by
    default; put a TLS-terminating reverse proxy in front to serve other machines.
    """
    _require_extra()
    import uvicorn

    from rootstock.dashboard.app import create_app
    from rootstock.dashboard.db import database_url, describe_url

    url = database_url(db)
    _migrated_engine(url).dispose()
    app = create_app(url, max_body=max_body, keep_bodies=keep_bodies)
    sock = _listen(host, port)
    bound_port = sock.getsockname()[1]
    shown_host = f"[{host}]" if ":" in host else host
    click.echo(f"database: {describe_url(url)}")
    click.echo(f"dashboard: http://{shown_host}:{bound_port}/", nl=True)
    config = uvicorn.Config(app, log_level=log_level, proxy_headers=False, server_header=False)
    server = uvicorn.Server(config)
    # Everything loaded so far (the web stack, SQLAlchemy, the templates) lives as long
    # as the server: moved out of the collector's view, a full collection scans only
    # what requests allocate (2-5 ms instead of 60-120 ms on a push).
    gc.collect()
    gc.freeze()
    server.run(sockets=[sock])


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, or a clear error (port taken, bad address)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise RootstockError(
            f"cannot listen on {host!r}: {exc.strerror}", hint="pass an address with --host"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise RootstockError(
            f"cannot listen on {host}:{port}: {exc.strerror}",
            hint="pick another --port, or stop what is listening there",
        ) from None
    sock.set_inheritable(True)
    return sock


@dashboard.command("add-cluster")
@click.argument("name")
@_db_option
def add_cluster(name: str, db: str | None) -> None:
    """Register a cluster that may push manifests (lower-case, as in the registry)."""
    from rootstock.dashboard import credentials

    with _transaction(db) as session:
        credentials.add_cluster(session, name)
    click.echo(f"added cluster {name}")
    next_step(f"rootstock dashboard issue-key --cluster {name} --maintainer EMAIL")


@dashboard.command("issue-key")
@click.option(
    "--cluster",
    "clusters",
    multiple=True,
    required=True,
    metavar="NAME",
    help="A cluster the key may write to (repeatable).",
)
@click.option("--maintainer", required=True, metavar="EMAIL", help="Who holds the key.")
@_db_option
@click.option("--json", "as_json", is_flag=True, help="Print the key and secret as JSON.")
def issue_key(clusters: tuple[str, ...], maintainer: str, db: str | None, as_json: bool) -> None:
    """Issue an API key and print its secret, once (only a hash of it is kept)."""
    from rootstock.dashboard import credentials

    with _transaction(db) as session:
        issued = credentials.issue_key(session, list(clusters), maintainer)
    if as_json:
        emit_json(issued.to_dict())
        return
    click.echo(f"api_key:    {issued.key_id}")
    click.echo(f"api_secret: {issued.secret}")
    click.echo(
        f"scoped to {', '.join(issued.clusters)} for {issued.maintainer}. The secret is "
        "shown only now: put both in the maintainer's config.toml (rootstock init asks "
        "for them).",
        err=True,
    )


@dashboard.command("revoke-key")
@click.argument("key_id")
@_db_option
def revoke_key(key_id: str, db: str | None) -> None:
    """Revoke an API key: its next push gets 401."""
    from rootstock.dashboard import credentials

    with _transaction(db) as session:
        key = credentials.revoke_key(session, key_id)
        revoked_at = key.revoked_at
    assert revoked_at is not None  # revoke_key always leaves the key revoked
    click.echo(f"revoked {key_id} (at {revoked_at.isoformat(timespec='seconds')})")


@dashboard.command("keys")
@_db_option
@click.option("--json", "as_json", is_flag=True, help="Print the keys as JSON.")
def keys(db: str | None, as_json: bool) -> None:
    """List API keys with their maintainer, clusters and state (never secrets)."""
    from rootstock.dashboard import credentials

    with _transaction(db) as session:
        rows = credentials.list_keys(session)
    if as_json:
        emit_json({"keys": rows})
        return
    if not rows:
        click.echo("no keys issued yet (rootstock dashboard issue-key)")
        return
    # The key id is what revoke-key needs: never truncate it on a narrow terminal.
    tab = table(None, ["key", "maintainer", "clusters", "created", "revoked"], whole=("key",))
    for row in rows:
        tab.add_row(
            row["api_key"],
            row["maintainer"],
            ", ".join(row["clusters"]),
            _short_time(row["created_at"]),
            _short_time(row["revoked_at"]),
        )
    print_table(console(), tab)


def _short_time(iso: str | None) -> str:
    """``2026-11-29 13:21`` from an ISO-8601 UTC time (the table's width is precious)."""
    return "" if not iso else iso[:16].replace("T", " ")
