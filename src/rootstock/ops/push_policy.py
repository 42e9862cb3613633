"""When a command pushes to the dashboard, and what it says about each push.

``install``, ``add``, ``smoke-test`` and ``manifest init`` push after the local
manifest is saved. A push that fails is a warning that names ``rootstock manifest
push`` as the retry; it never changes the exit code.

Nothing here prints. Each function returns the lines to show (:class:`PushNotice`),
or, for the snapshots that ``smoke-test --push-every`` pushes from a background
thread, hands them to a callback as they arise; ``cli/push_hooks`` prints them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rootstock.errors import RootstockError
from rootstock.install.layout import InstallLayout
from rootstock.ops.http_client import Deadline
from rootstock.ops.push import RETRY_COMMAND, Dashboard, PushReport
from rootstock.ops.snapshot_push import SnapshotPusher


@dataclass(frozen=True)
class PushNotice:
    """One stderr line about a push: a warning, or the news that a cluster was pushed."""

    text: str
    warning: bool = False


@dataclass
class PushDecision:
    """Whether a command pushes (``dashboard`` None: it does not), and why not."""

    dashboard: Dashboard | None
    warnings: list[str] = field(default_factory=list)


@dataclass
class CommandPush:
    """The push after a command: its report (None when none was sent) and its lines."""

    report: PushReport | None
    notices: list[PushNotice] = field(default_factory=list)


def decide_push(no_push: bool, asked_by: str | None = None) -> PushDecision:
    """The dashboard to push to after a command, or none, with the warnings to show.

    A maintainer (``is_maintainer = true`` in config.toml) with ``api_url``,
    ``api_key`` and ``api_secret`` pushes. ``asked_by`` names an option that asked
    for pushes explicitly (``--push-every``): then credentials alone suffice, and
    their absence is a warning. A maintainer with no dashboard at all is left alone.
    """
    from rootstock.install.config import config_path, load_config
    from rootstock.ops.push import dashboard_settings, missing_credentials

    if no_push:
        warnings = [f"{asked_by} is ignored with --no-push"] if asked_by else []
        return PushDecision(None, warnings)
    try:
        config = load_config()
        if not (config.get("is_maintainer") or asked_by):
            return PushDecision(None)
        missing = missing_credentials(config)
        if missing:
            if asked_by or config.get("api_url") or config.get("api_key"):
                return PushDecision(
                    None,
                    [
                        f"not pushing to the dashboard: {', '.join(missing)} missing from "
                        f"{config_path()}; results are only saved locally "
                        "(set them with `rootstock init --force --api-url ... --api-key ... "
                        "--api-secret-file ...`)"
                    ],
                )
            return PushDecision(None)
        return PushDecision(dashboard_settings(config))
    except RootstockError as exc:
        return PushDecision(None, [f"not pushing to the dashboard: {exc}"])


def push_after_command(
    command: str,
    layout: InstallLayout,
    dashboard: Dashboard | None,
    clusters: Iterable[str] | None = None,
    deadline: Deadline | None = None,
) -> CommandPush:
    """Push the manifest after ``command``; a failure is a warning, never an error.

    ``deadline`` bounds the push's retries (default: a fresh retry cap).
    """
    from rootstock.ops.push import push_manifest

    if dashboard is None:
        return CommandPush(None)
    try:
        report = push_manifest(layout, clusters, dashboard, deadline)
    except (RootstockError, OSError) as exc:
        text = (
            f"{command}: the manifest is saved locally but was not pushed ({exc}); "
            f"retry with `{RETRY_COMMAND}`"
        )
        return CommandPush(None, [PushNotice(text, warning=True)])
    return CommandPush(report, push_notices(report, command))


def push_notices(
    report: PushReport, command: str, seen: set[str] | None = None
) -> list[PushNotice]:
    """One line per cluster: pushed, or a warning that names the retry.

    ``seen`` collects warnings already returned, so repeated snapshot failures with
    the same cause are reported once.
    """
    # Clusters not tried because the dashboard proved unreachable join the warning of
    # the failure that proved it (the last one tried).
    tried = [r for r in report.failures if r.attempts]
    not_tried = [r.cluster for r in report.failures if not r.attempts]
    notices: list[PushNotice] = []
    for result in report.results:
        if result.ok:
            push_id = (result.response or {}).get("push_id")
            suffix = f" (push {push_id})" if push_id is not None else ""
            notices.append(
                PushNotice(f"pushed the {result.cluster} manifest to {report.api_url}{suffix}")
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
        notices.append(PushNotice(text, warning=True))
    return notices


class SnapshotPushes:
    """The ``--push-every`` snapshots of one smoke-test or sync run, pushed in the background."""

    def __init__(self, pusher: SnapshotPusher, dashboard: Dashboard) -> None:
        self.pusher = pusher
        self.dashboard = dashboard

    def on_snapshot(self, _done: int) -> None:
        """Queue a snapshot (``smoke_test``'s ``on_snapshot``); returns at once."""
        self.pusher.request()

    def finish(self) -> Deadline:
        """Wait for the snapshot in flight; return the deadline the final push shares.

        The snapshot still in flight and the final push share one retry cap, so a
        dashboard that drops packets holds the job up about one cap, not two.
        """
        deadline = Deadline(self.dashboard.policy.total_cap)
        self.pusher.close(deadline)
        return deadline


@contextmanager
def snapshot_pushes(
    layout: InstallLayout,
    dashboard: Dashboard | None,
    cluster: str | None,
    every: int | None,
    on_notice: Callable[[PushNotice], None],
    command: str = "smoke-test",
) -> Iterator[SnapshotPushes | None]:
    """Yield the snapshot pushes of ``<command> --push-every``, or None without pushes.

    Each snapshot is ``cluster``'s view; the lines about it go to ``on_notice`` on the
    pushing thread, a failure repeated with the same cause only once. Leaving on an
    exception (Ctrl-C) abandons a snapshot in flight instead of waiting.
    """
    if dashboard is None or cluster is None or not every:
        yield None
        return
    from rootstock.ops.push import push_manifest

    seen: set[str] = set()

    def on_report(report: PushReport) -> None:
        for notice in push_notices(report, f"{command} --push-every", seen):
            on_notice(notice)

    pusher = SnapshotPusher(
        lambda: push_manifest(layout, [cluster], dashboard),
        on_report=on_report,
        join_timeout=dashboard.policy.total_cap + 5.0,
    )
    with pusher:
        yield SnapshotPushes(pusher, dashboard)
