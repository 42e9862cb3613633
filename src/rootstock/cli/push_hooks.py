"""The dashboard pushes after ``install``, ``add``, ``smoke-test`` and ``manifest init``, as
the CLI shows them.

Whether to push and what each push says is decided in :mod:`rootstock.ops.push_policy`;
this module only prints it: a warning as a ``warning:`` line, a pushed cluster as a
plain line, both on stderr.
"""

from __future__ import annotations

from collections.abc import Iterable

import click

from rootstock.cli.common import warn
from rootstock.install.layout import InstallLayout
from rootstock.ops.http_client import Deadline
from rootstock.ops.push import Dashboard, PushReport
from rootstock.ops.push_policy import PushNotice, decide_push, push_after_command


def auto_push_dashboard(no_push: bool, asked_by: str | None = None) -> Dashboard | None:
    """The dashboard to push to after a command, or None; prints why not, if it should.

    See :func:`rootstock.ops.push_policy.decide_push` for the rule.
    """
    decision = decide_push(no_push, asked_by)
    for line in decision.warnings:
        warn(line)
    return decision.dashboard


def push_after(
    command: str,
    layout: InstallLayout,
    dashboard: Dashboard | None,
    clusters: Iterable[str] | None = None,
    deadline: Deadline | None = None,
) -> PushReport | None:
    """Push the manifest after ``command`` and print the outcome; never raises for it.

    ``deadline`` bounds the push's retries (default: a fresh retry cap).
    """
    pushed = push_after_command(command, layout, dashboard, clusters, deadline)
    for notice in pushed.notices:
        show_notice(notice)
    return pushed.report


def show_notice(notice: PushNotice) -> None:
    """Print one line about a push on stderr (a warning gets the ``warning:`` prefix)."""
    if notice.warning:
        warn(notice.text)
    else:
        click.echo(notice.text, err=True)
