"""Alembic environment of the dashboard (run by :func:`rootstock.dashboard.db.migrate`).

There is no alembic.ini: ``migrate`` passes an open connection in
``config.attributes["connection"]`` and already holds its transaction.
"""

from __future__ import annotations

from alembic import context

from rootstock.dashboard.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run dashboard migrations through rootstock.dashboard.db.migrate")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    # SQLite cannot ALTER most things in place; batch mode rebuilds the table.
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
