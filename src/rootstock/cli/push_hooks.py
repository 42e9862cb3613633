"""Automatic dashboard pushes after ``install``, ``add``, ``smoke-test`` and ``manifest init``.

They run after the local manifest is saved. A push that fails is a warning that
names ``rootstock manifest push`` as the retry; it never changes the exit code.
"""

from __future__ import annotations

from collections.abc import Iterable

import click

from rootstock.cli.common import warn
from rootstock.errors import RootstockError
from rootstock.install.layout import InstallLayout
from rootstock.ops.http_client import Deadline
from rootstock.ops.push import RETRY_COMMAND, Dashboard, PushReport


def auto_push_dashboard(no_push: bool, asked_by: str | None = None) -> Dashboard | None:
    """The dashboard to push to after a command, or None for no push.

    A maintainer (``is_maintainer = true`` in config.toml) with ``api_url``,
    ``api_key`` and ``api_secret`` pushes. ``asked_by`` names an option that asked
    for pushes explicitly (``--push-every``): then credentials alone suffice, and
    their absence is a warning. A maintainer with no dashboard at all is left alone.
    """
    from rootstock.install.config import config_path, load_config
    from rootstock.ops.push import dashboard_settings, missing_credentials

    if no_push:
        if asked_by:
            warn(f"{asked_by} is ignored with --no-push")
        return None
    try:
        config = load_config()
        if not (config.get("is_maintainer") or asked_by):
            return None
        missing = missing_credentials(config)
        if missing:
            if asked_by or config.get("api_url") or config.get("api_key"):
                warn(
                    f"not pushing to the dashboard: {', '.join(missing)} missing from "
                    f"{config_path()}; results are only saved locally "
                    "(set them with `rootstock init --force --api-url ... --api-key ... "
                    "--api-secret-file ...`)"
                )
            return None
        return dashboard_settings(config)
    except RootstockError as exc:
        warn(f"not pushing to the dashboard: {exc}")
        return None


def push_after(
    command: str,
    layout: InstallLayout,
    dashboard: Dashboard | None,
    clusters: Iterable[str] | None = None,
    deadline: Deadline | None = None,
) -> PushReport | None:
    """Push the manifest after ``command``; failures are warnings, never errors.

    ``deadline`` bounds the push's retries (default: a fresh retry cap).
    """
    from rootstock.ops.push import push_manifest

    if dashboard is None:
        return None
    try:
        report = push_manifest(layout, clusters, dashboard, deadline)
    except (RootstockError, OSError) as exc:
        warn(
            f"{command}: the manifest is saved locally but was not pushed ({exc}); "
            f"retry with `{RETRY_COMMAND}`"
        )
        return None
    announce(report, command)
    return report


def announce(report: PushReport, command: str, seen: set[str] | None = None) -> None:
    """One stderr line per cluster: pushed, or a warning that names the retry.

    ``seen`` collects warnings already printed, so repeated snapshot failures with
    the same cause are reported once.
    """
    # Clusters not tried because the dashboard proved unreachable join the warning of
    # the failure that proved it (the last one tried).
    tried = [r for r in report.failures if r.attempts]
    not_tried = [r.cluster for r in report.failures if not r.attempts]
    for result in report.results:
        if result.ok:
            push_id = (result.response or {}).get("push_id")
            suffix = f" (push {push_id})" if push_id is not None else ""
            click.echo(
                f"pushed the {result.cluster} manifest to {report.api_url}{suffix}", err=True
            )
            continue
        if tried and not result.attempts:
            continue
        names = [result.cluster]
        if tried and result is tried[-1]:
            names += not_tried
        text = (
            f"{command}: pushing cluster{'s' if len(names) > 1 else ''} {', '.join(names)} "
            f"to {report.api_url} failed: "
            f"{result.message}; the local manifest is saved, retry with `{RETRY_COMMAND}`"
        )
        if result.hint:
            text += f"\n  hint: {result.hint}"
        if seen is not None:
            if text in seen:
                continue
            seen.add(text)
        warn(text)
