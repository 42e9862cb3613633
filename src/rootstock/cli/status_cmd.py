"""``rootstock status``."""

from __future__ import annotations

from typing import Any

import click

from rootstock.cli.common import (
    console,
    emit_json,
    layout_from,
    print_table,
    root_options,
    table,
    warn,
)

_STYLE = {
    "verified": "green",
    "failed": "red",
    "drifted": "magenta",
    "tampered": "red",
    "stale": "yellow",
    "fetched": "cyan",
    "not fetched": "dim",
    "gated": "yellow",
}


def _age(seconds: float | None) -> str:
    if seconds is None:
        return ""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def describe_size(n: float | None) -> str:
    """Bytes as ``512 B``, ``11.2 MB``, ``3.4 GB`` (``-`` for unknown)."""
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def describe_state(state: dict[str, Any]) -> str:
    """One cell of the grid: the state, its device and age, or the failure reason."""
    text = state["state"]
    if text in ("verified", "drifted", "stale", "failed", "tampered") and state.get("device"):
        text += f" ({state['device']}, {_age(state.get('age_s'))})"
    if text.startswith(("failed", "stale", "tampered")) and state.get("message"):
        text += f": {state['message']}"
    style = _STYLE.get(state["state"], "")
    return f"[{style}]{text}[/{style}]" if style else text


@click.command()
@root_options
@click.option("--sizes", is_flag=True, help="Also measure env and cache sizes (slow on Lustre).")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(
    root: str | None, cluster: str | None, cache_root: str | None, sizes: bool, as_json: bool
) -> None:
    """Show envs, their build state, and every checkpoint's state per cluster."""
    from rootstock.ops.status import status as run_status

    doc = run_status(layout_from(root, cluster, cache_root), cluster, sizes)
    if as_json:
        emit_json(doc)  # no rich on this path: scripts poll it
        return
    from rich.markup import escape

    for line in doc["warnings"]:
        warn(line)
    out = console()
    # One field a line, printed as it is: rich would wrap it at its own width (80
    # columns off a terminal), parting a label from its value or cutting a path.
    for label, value in (
        ("root", doc["root"]),
        ("cache root", doc["cache_root"]),
        ("clusters", ", ".join(doc["clusters"]) or "-"),
    ):
        out.print(f"{label}: {value}", markup=False, soft_wrap=True)
    columns = ["env", "state", "python", "torch", "built"] + (["size"] if sizes else [])
    envs = table("envs", columns, whole=("env",))
    for env in doc["envs"]:
        state = env["state"] + (" (hotfixed)" if env["hotfixed"] else "")
        if env["error"]:
            state = f"[red]{state}: {escape(env['error'])}[/red]"
        cells = [
            env["name"],
            state,
            env["python"] or "-",
            env["torch"] or "-",
            (env["built_at"] or "-").replace("T", " ").replace("+00:00", "Z"),
        ]
        if sizes:
            cells.append(describe_size(env.get("size_bytes")))
        envs.add_row(*cells)
    print_table(out, envs)
    grid = table(
        "checkpoints", ["env", "checkpoint", *doc["clusters"]], whole=("env", "checkpoint")
    )
    for env in doc["envs"]:
        for row in env["checkpoints"]:
            grid.add_row(
                env["name"],
                row["id"],
                *(
                    describe_state(row["states"][c]) if c in row["states"] else "-"
                    for c in doc["clusters"]
                ),
            )
    if grid.row_count:
        print_table(out, grid)
    if sizes:
        caches = doc["cache_size_bytes"]
        out.print(
            f"cache: {describe_size(caches['cache'])}   home: {describe_size(caches['home'])}"
        )
