"""The dashboard's HTML pages: the coverage matrix, a cluster's page, the catalogue, usage.

Rendered on the server by Jinja2 with autoescaping on for every template, so
anything a push carries (env names, checkpoint ids, messages) lands in the page as
text. The pages need no JavaScript: filters are a GET form, the usage chart is SVG
drawn here. A Content-Security-Policy that allows no script at all backs that up.

The templates get display-ready values (labels, ages, CSS classes) computed here,
so a 50 x 300 matrix renders in a single pass without per-cell template logic.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, PackageLoader
from markupsafe import Markup, escape

from rootstock.dashboard import catalogue, views
from rootstock.install.manifest import parse_time as manifest_time
from rootstock.names import CLUSTER_NAME_PATTERN

router = APIRouter(include_in_schema=False)

TEMPLATES = Environment(
    loader=PackageLoader("rootstock.dashboard", "templates"),
    autoescape=True,  # every template, whatever its file name
    trim_blocks=True,
    lstrip_blocks=True,
)

# No script may run on these pages; inline <style> in the base template is the only
# inline resource.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
        "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}

# The order of the legend and the state filter: best to worst, then not checked.
PAGE_STATES = ("verified", "stale", "drifted", "failed", "tampered", "fetched", "not fetched")
STATE_HELP = {
    "verified": "last check matched the reference fingerprint",
    "stale": "env rebuilt or hotfixed since the last check",
    "drifted": "ran, but moved beyond tolerance from the reference",
    "failed": "last check failed",
    "tampered": "a weight file changed since it was added; the model was not run",
    "fetched": "weights downloaded, never checked here",
    "not fetched": "declared, weights not downloaded",
}
CHART_LIMIT = 40  # bars in the usage chart; the table below it lists every checkpoint


def state_class(state: str | None) -> str:
    """The CSS class of a state (``not fetched`` -> ``s-not-fetched``)."""
    return "s-" + (state or "none").replace(" ", "-")


def parse_time(text: str | None) -> datetime | None:
    """An ISO-8601 time from a manifest, in UTC; None when absent or unreadable."""
    moment = manifest_time(text)
    if moment is None:
        return None
    try:
        return moment.astimezone(UTC)
    except OverflowError:  # a time at the very ends of the calendar
        return None


def age_label(text: str | None, now: datetime) -> str:
    """How long ago ``text`` was, short: ``now``, ``12 min``, ``3 h``, ``2 d``, ``5 mo``."""
    moment = parse_time(text)
    if moment is None:
        return ""
    seconds = max(0.0, (now - moment).total_seconds())
    if seconds < 60:
        return "now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h"
    if seconds < 60 * 86400:
        return f"{int(seconds // 86400)} d"
    return f"{int(seconds // (30 * 86400))} mo"


def when_label(text: str | None) -> str:
    """A time for people: ``2026-11-28 10:00 UTC`` (the raw text when unreadable)."""
    moment = parse_time(text)
    if moment is None:
        return text or ""
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def render(name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """Render ``templates/<name>`` into an HTML response with the security headers."""
    html = TEMPLATES.get_template(name).render(**context)
    return HTMLResponse(html, status_code=status_code, headers=SECURITY_HEADERS)


def _clean(value: str | None) -> str | None:
    """A query parameter, with an empty one (the form's "all") meaning no filter.

    A value no stored name can hold (a NUL, which PostgreSQL text refuses) is no
    filter either, rather than a database error.
    """
    value = (value or "").strip()
    return value if value and "\x00" not in value else None


@router.get("/", response_class=HTMLResponse)
def coverage_page(
    request: Request, family: str | None = None, state: str | None = None
) -> HTMLResponse:
    """The coverage matrix: checkpoints grouped by family x clusters."""
    family, state = _clean(family), _clean(state)
    with request.app.state.sessions() as session:
        matrix = views.matrix(session, family=family, state=state)
    now = datetime.now(UTC)
    clusters = [
        {
            "name": name,
            "title": f"last push {when_label(views.iso_time(at))}",
            "age": age_label(views.iso_time(at), now),
        }
        for name, at in matrix.clusters
    ]
    cell_html: dict[tuple, str] = {}
    groups: list[dict[str, Any]] = []
    for checkpoint, row_family, cells in matrix.rows:
        if not groups or groups[-1]["family"] != row_family:
            groups.append({"family": row_family, "rows": [], "states": set()})
        states = {cell[1] for cell in cells if cell is not None}
        groups[-1]["states"] |= states
        groups[-1]["rows"].append(
            {
                "checkpoint": checkpoint,
                "states": " ".join(sorted(states)),
                # Markup: every value in the cells was escaped by _cell.
                "cells": Markup("".join([_cell(cell, now, cell_html) for cell in cells])),
            }
        )
    for group in groups:
        group["states"] = " ".join(sorted(group["states"]))
    return render(
        "coverage.html",
        title="Coverage",
        nav="coverage",
        clusters=clusters,
        groups=groups,
        families=matrix.families,
        states=PAGE_STATES,
        state_help=STATE_HELP,
        state_class=state_class,
        family=family,
        state=state,
        filtered=bool(family or state),
        rows=len(matrix.rows),
        generated_at=when_label(views.iso_time(matrix.generated_at)),
    )


EMPTY_CELL = '<td class="s-none">·</td>'


def _cell(cell: views.Cell | None, now: datetime, cache: dict[tuple, str]) -> str:
    """One matrix cell as HTML, every value in it escaped.

    Built here rather than in the template because a 50 x 300 matrix is 15,000 cells:
    one f-string with explicit escapes per distinct cell is several times faster than
    template logic per cell. Cells with the same content share one rendering (the row
    and column already name the checkpoint and cluster, so the tooltip need not).
    """
    if cell is None:
        return EMPTY_CELL
    html = cache.get(cell)
    if html is None:
        env, state, verified_at, kind, message = cell
        lines = [f"{state} ({kind})" if kind else state]
        if verified_at:
            lines.append(f"checked {verified_at}")
        lines.append(f"env {env}")
        if message:
            lines.append(message)
        html = (
            f'<td class="{escape(state_class(state))}" title="{escape(chr(10).join(lines))}">'
            f"{escape(state)}<small>{escape(age_label(verified_at, now))}</small></td>"
        )
        cache[cell] = html
    return html


CHECKED_QUANTITIES = ("forces", "stress")


def check_labels(checks: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One label per checked quantity: ``forces 1.000``, ``stress 160.2``, ``stress n/a``.

    The ratio is the model's value over the finite difference of the energy; a loose
    (``direct``) mode is named after it. Values that are not what rootstock writes
    are shown as ``?`` rather than trusted.
    """
    labels = []
    for quantity in CHECKED_QUANTITIES:
        check = (checks or {}).get(quantity)
        if not isinstance(check, dict):
            continue
        mode, ratio, ok = check.get("mode"), check.get("ratio"), check.get("ok")
        if mode == "n/a":
            text = f"{quantity} n/a"
        elif isinstance(ratio, int | float) and not isinstance(ratio, bool):
            text = f"{quantity} {ratio:.4g}" if abs(ratio) >= 10 else f"{quantity} {ratio:.3f}"
        else:
            text = f"{quantity} ?"
        if isinstance(mode, str) and mode not in ("gradient", "n/a"):
            text += f" ({mode})"
        message = check.get("message")
        labels.append(
            {
                "quantity": quantity,
                "text": text,
                "ok": ok is not False,
                "title": message if isinstance(message, str) else "model / finite difference",
            }
        )
    return labels


@router.get("/clusters/{name}", response_class=HTMLResponse)
def cluster_page(request: Request, name: str) -> HTMLResponse:
    """One cluster: its envs and versions, its pushes, each checkpoint's history."""
    detail = pushes = None
    # A name that could never be added is unknown without asking the database.
    if CLUSTER_NAME_PATTERN.fullmatch(name):
        with request.app.state.sessions() as session:
            detail = views.cluster_detail(session, name)
            pushes = views.push_history(session, name, limit=10) if detail else None
    # Clusters are never removed, so pushes is None only when detail is: checked for the type.
    if detail is None or pushes is None:
        return render(
            "not_found.html",
            status_code=404,
            title="Unknown cluster",
            nav="",
            what=f"No cluster named “{name}” is registered on this dashboard.",
        )
    now = datetime.now(UTC)
    history = []
    for row in detail["checkpoints"] + detail["retired"]:
        retired = "state" not in row
        for event in row["history"]:
            history.append(
                {
                    "checkpoint": row["checkpoint"],
                    "env": row["env"],
                    "retired": retired,
                    **event,
                    "when": when_label(event["at"]),
                    "age": age_label(event["at"], now),
                    "cls": state_class(event["state"]),
                    "check_labels": check_labels(event.get("checks")),
                }
            )
    checkpoints = [
        {
            **row,
            "cls": state_class(row["state"]),
            "when": when_label(row["verified_at"]),
            "age": age_label(row["verified_at"], now),
        }
        for row in detail["checkpoints"]
    ]
    envs = [{**env, "built": when_label(env["built_at"])} for env in detail["envs"]]
    return render(
        "cluster.html",
        title=detail["cluster"],
        nav="",
        cluster=detail,
        envs=envs,
        checkpoints=checkpoints,
        history=history,
        history_limit=views.HISTORY_LIMIT,
        pushes=[{**p, "when": when_label(p["received_at"])} for p in pushes["pushes"]],
        last_push=when_label(detail["last_push_at"]),
        last_push_age=age_label(detail["last_push_at"], now),
    )


_DOI = re.compile(r"^10\.\d{4,9}/\S+$")
_ARXIV = re.compile(r"^arXiv:(\S+)$")
_WEB = re.compile(r"^https?://\S+$")


def citation_link(citation: str | None) -> str | None:
    """Where a citation resolves: ``https://doi.org/<doi>`` or ``https://arxiv.org/abs/<id>``.

    None for anything else (shown as text only, never as a link).
    """
    if not citation:
        return None
    if _DOI.match(citation):
        return f"https://doi.org/{citation}"
    found = _ARXIV.match(citation)
    return f"https://arxiv.org/abs/{found.group(1)}" if found else None


def web_link(url: str | None) -> str | None:
    """``url`` when it is an http(s) URL, so a pushed value never becomes another scheme's link."""
    return url if url and _WEB.match(url) else None


@router.get("/catalogue", response_class=HTMLResponse)
def catalogue_page(request: Request) -> HTMLResponse:
    """Every checkpoint across clusters: licence, gating, citation, where it is verified."""
    with request.app.state.sessions() as session:
        found = catalogue.catalogue(session)
    now = datetime.now(UTC)
    cache: dict[tuple, str] = {}
    entries = []
    for entry in found["checkpoints"]:
        verified: list[str] = []
        other: list[str] = []
        for place in entry["clusters"]:
            devices = place["devices"] or [
                {"device_kind": None, "device": None, "state": place["state"], "at": None,
                 "message": place["message"]}
            ]  # fmt: skip
            for device in devices:
                target = verified if device["state"] == "verified" else other
                target.append(_device_item(place["cluster"], device, now, cache))
        entries.append(
            {
                **entry,
                "citation_url": citation_link(entry["citation"]),
                "gated_url": web_link(entry["gated"]),
                # Markup: every value in the items was escaped by _device_item.
                "verified": Markup("".join(verified)),
                "other": Markup("".join(other)),
            }
        )
    return render(
        "catalogue.html",
        title="Catalogue",
        nav="catalogue",
        entries=entries,
        generated_at=when_label(found["generated_at"]),
    )


def _device_item(
    cluster: str, device: dict[str, Any], now: datetime, cache: dict[tuple, str]
) -> str:
    """One cluster's result for one device kind as an ``<li>``, every value escaped.

    Built here, like the matrix cells, because 50 clusters x 300 checkpoints is 15,000
    items: one f-string per distinct item is several times faster than template logic
    per item, and a smoke-test run gives many checkpoints the same result.
    """
    kind, name, state = device["device_kind"], device["device"], device["state"]
    at, message = device["at"], device["message"]
    key = (cluster, kind, name, state, at, message)
    html = cache.get(key)
    if html is not None:
        return html
    link = f'<a href="/clusters/{escape(quote(cluster, safe=""))}">{escape(cluster)}</a>'
    when = when_label(at)
    if state == "verified":
        age = age_label(at, now)
        html = (
            f'<li data-cluster="{escape(cluster)}">{link} '
            f'<span class="badge {state_class(state)}">{escape(kind or "")}</span> '
            f"{escape(name or '')} "
            f'<span class="muted" title="{escape(at or "")}">{escape(when)}'
            f"{f' ({escape(age)})' if age else ''}</span></li>"
        )
    else:
        label = f"{state} ({kind})" if kind else str(state)
        html = (
            f'<li data-cluster="{escape(cluster)}" data-state="{escape(state)}">{link} '
            f'<span class="badge {escape(state_class(state))}" title="{escape(message or "")}">'
            f"{escape(label)}</span>"
            + (f' <span class="muted" title="{escape(at)}">{escape(when)}</span>' if at else "")
            + (f'<span class="msg">{escape(message)}</span>' if message else "")
            + "</li>"
        )
    cache[key] = html
    return html


@router.get("/usage", response_class=HTMLResponse)
def usage_page(request: Request, month: str | None = None) -> HTMLResponse:
    """Monthly sessions and distinct users per checkpoint: an SVG chart and a table."""
    with request.app.state.sessions() as session:
        summary = views.usage_summary(session)
    months = summary["months"]
    month = _clean(month)
    if month not in summary["by_month"]:
        month = months[0] if months else None
    entries = summary["by_month"].get(month, []) if month else []
    totals = [
        {
            "month": m,
            "sessions": sum(e["sessions"] for e in summary["by_month"][m]),
            "distinct_users": sum(e["distinct_users"] for e in summary["by_month"][m]),
            "checkpoints": len(summary["by_month"][m]),
        }
        for m in months
    ]
    return render(
        "usage.html",
        title="Usage",
        nav="usage",
        months=months,
        month=month,
        entries=entries,
        totals=totals,
        chart=usage_chart(entries[:CHART_LIMIT]),
        more=max(0, len(entries) - CHART_LIMIT),
    )


def usage_chart(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Geometry of a horizontal bar chart: per checkpoint, sessions and distinct users.

    Numbers only; the template draws the SVG (so every label is escaped like the
    rest of the page).
    """
    label_width, bar_area, bar, gap, top = 260, 440, 11, 10, 28
    peak = _nice_ceiling(
        max([e["sessions"] for e in entries] + [e["distinct_users"] for e in entries] + [5])
    )
    rows = []
    for index, entry in enumerate(entries):
        y = top + index * (2 * bar + gap)
        rows.append(
            {
                "checkpoint": entry["checkpoint"],
                "sessions": entry["sessions"],
                "users": entry["distinct_users"],
                "y": y,
                "sessions_width": round(bar_area * entry["sessions"] / peak, 1),
                "users_width": round(bar_area * entry["distinct_users"] / peak, 1),
            }
        )
    return {
        "rows": rows,
        "label_width": label_width,
        "bar": bar,
        "width": label_width + bar_area + 70,
        "height": top + len(entries) * (2 * bar + gap) + 6,
        "ticks": [
            {"x": label_width + bar_area * i / 5, "value": _tick(peak * i / 5)} for i in range(6)
        ],
    }


def _nice_ceiling(value: float) -> float:
    """The smallest 1, 2, 2.5, 5 or 10 x 10^k at or above ``value``, for round ticks."""
    scale = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if step * scale >= value:
            return step * scale
    return 10 * scale


def _tick(value: float) -> str:
    return f"{value:g}"
