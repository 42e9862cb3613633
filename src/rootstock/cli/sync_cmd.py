"""``rootstock sync``: build what is missing, download what is declared, verify what is stale."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

from rootstock.cli.common import emit_json, layout_from, root_options
from rootstock.cli.options import DEVICE, JOBS, CheckedBy, push_every_option, verify_timeout_option

if TYPE_CHECKING:
    from rich.status import Status

    from rootstock.install.layout import InstallLayout
    from rootstock.ops.sync import ItemResult, SyncReport, SyncRun
    from rootstock.ops.sync_plan import PlanItem, SyncPlan


def _phases(value: Any) -> tuple[str, ...]:
    # Imported when the option is parsed, so `sync --help` loads none of the ops.
    from rootstock.ops.sync import parse_phases

    return parse_phases(value)


PHASES = CheckedBy("phases", _phases)


@click.command()
@click.argument("source", required=False)
@root_options
@click.option(
    "--env", "env_names", multiple=True, metavar="NAME", help="Only this env. Repeatable."
)
@click.option(
    "--checkpoint", "checkpoints", multiple=True, metavar="ID", help="Only this id. Repeatable."
)
@click.option(
    "--phases",
    type=PHASES,
    default="build,download,verify",
    show_default=True,
    help="The phases to run, any subset (always run in this order).",
)
@click.option("--rebuild", is_flag=True, help="Rebuild every env in scope (from its lockfile).")
@click.option(
    "--upgrade", is_flag=True, help="Rebuild re-resolving to the newest allowed versions."
)
@click.option(
    "--device", type=DEVICE, default="cuda", show_default=True, help="Verify on cpu, cuda[:N]..."
)
@verify_timeout_option
@click.option(
    "--jobs", type=JOBS, default=4, show_default=True, help="Builds and downloads run N at once."
)
@click.option(
    "--verify-jobs",
    type=JOBS,
    default=1,
    show_default=True,
    help="Verify N checkpoints at once (cuda: one GPU each, cuda:0..N-1).",
)
@click.option("--fail-fast", is_flag=True, help="Stop at the first failure; cancel what waits.")
@click.option(
    "--image/--no-image",
    default=None,
    help="Pack an image of each build (default: the root's setting, see `init --no-images`).",
)
@click.option(
    "--rehash",
    is_flag=True,
    help="Before each verification, re-hash every weight file (default: only files "
    "whose size or mtime changed since add).",
)
@push_every_option
@click.option("--no-push", is_flag=True, help="Do not push the manifest to the dashboard.")
@click.option("--no-perm-check", is_flag=True, help="Skip the up-front permission check.")
@click.option("--dry-run", is_flag=True, help="Show the plan; build, fetch and verify nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan and the results as JSON.")
def sync(
    source: str | None,
    root: str | None,
    cluster: str | None,
    cache_root: str | None,
    env_names: tuple[str, ...],
    checkpoints: tuple[str, ...],
    phases: tuple[str, ...],
    rebuild: bool,
    upgrade: bool,
    device: str,
    verify_timeout: float,
    jobs: int,
    verify_jobs: int,
    fail_fast: bool,
    image: bool | None,
    rehash: bool,
    push_every: int | None,
    no_push: bool,
    no_perm_check: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Converge the install to SOURCE: build, download, then verify what is due.

    SOURCE is a directory of env files or git+URL[@REF][#subdirectory=DIR];
    without it, the registered sources in {root}/environments/ are used. Exit
    code 0 when converged (or nothing was to do), 1 when any item failed.
    """
    from rootstock.ops.sources import open_source
    from rootstock.ops.sync import SyncReport, SyncRun, finish_pending_prune_if_any, prepare_sync
    from rootstock.ops.sync_plan import SyncOptions

    layout = layout_from(root, cluster, cache_root)
    options = SyncOptions(
        phases=phases,
        envs=frozenset(env_names),
        checkpoints=frozenset(checkpoints),
        rebuild=rebuild,
        upgrade=upgrade,
    )
    run = SyncRun(
        device=device,
        verify_timeout=verify_timeout,
        jobs=jobs,
        verify_jobs=verify_jobs,
        fail_fast=fail_fast,
        upgrade=upgrade,
        image=image,
        rehash=rehash,
    )
    with open_source(layout, source) as opened:
        pending = None if dry_run else finish_pending_prune_if_any(layout)
        prepared = prepare_sync(
            layout, opened, options, cluster=cluster, device=device, rehash=rehash
        )
        report = SyncReport(prepared, dry_run, pending_prune=pending)
        if dry_run:
            if as_json:
                emit_json(report.to_dict())
            else:
                _render_plan(report)
            return
        if pending is not None and not as_json:
            click.echo(
                f"finished an interrupted prune: {len(pending.deleted)} deleted, "
                f"{len(pending.spared)} spared (in use)",
                err=True,
            )
        if prepared.plan.items or pending is not None:
            _execute(layout, report, no_perm_check, no_push, push_every, as_json, run)
    if as_json:
        emit_json(report.to_dict())
    else:
        _render_summary(report)
    if not report.ok:
        raise click.exceptions.Exit(1)


def _execute(
    layout: InstallLayout,
    report: SyncReport,
    no_perm_check: bool,
    no_push: bool,
    push_every: int | None,
    as_json: bool,
    run: SyncRun,
) -> None:
    """Run the plan with progress lines, snapshot pushes and the one push at the end."""
    from rootstock.cli.push_hooks import auto_push_dashboard, push_after, show_notice
    from rootstock.ops.push_policy import snapshot_pushes
    from rootstock.ops.sync import SyncHooks, execute_plan

    prepared = report.prepared
    if prepared.plan.items and not no_perm_check:
        from rootstock.cli.perms_cmd import warn_about_perms

        warn_about_perms(layout)
    dashboard = auto_push_dashboard(no_push, asked_by="--push-every" if push_every else None)
    cluster = prepared.state.cluster
    with snapshot_pushes(
        layout, dashboard, cluster, push_every, show_notice, command="sync"
    ) as snapshots:
        with _progress(len(prepared.plan.items), enabled=not as_json) as shown:
            hooks = SyncHooks(
                on_item_start=shown.start,
                on_item_step=shown.step,
                on_item_done=shown.done,
                snapshot_every=push_every if snapshots else None,
                on_snapshot=snapshots.on_snapshot if snapshots else lambda _n: None,
            )
            report.results = execute_plan(layout, prepared, run, hooks)
        deadline = snapshots.finish() if snapshots else None
    # Builds are shared by every cluster of the install: then push each one's view.
    built = any(r.status == "done" and r.item.phase == "build" for r in report.results)
    clusters = None if built or cluster is None else [cluster]
    push_after("sync", layout, dashboard, clusters, deadline)


class _Shown:
    """Progress of a running plan on stderr: one line per finished item, and on a
    terminal a live line naming what runs now."""

    def __init__(self, total: int, enabled: bool, status: Status | None) -> None:
        self.total = total
        self.enabled = enabled
        self.status = status
        self.finished = 0
        self.running: dict[str, str] = {}
        self.lock = threading.Lock()

    def _label(self, item: PlanItem) -> str:
        return f"{item.phase} {item.key}"

    def _refresh(self) -> None:
        if self.status is not None:
            now = "; ".join(self.running.values()) or "waiting"
            self.status.update(f"[{self.finished}/{self.total}] {now}")

    def start(self, item: PlanItem) -> None:
        with self.lock:
            self.running[self._label(item)] = self._label(item)
            self._refresh()

    def step(self, item: PlanItem, message: str) -> None:
        with self.lock:
            label = self._label(item)
            if label in self.running:
                # install_one's steps already start with the env's name.
                self.running[label] = f"{item.phase} {message}"
                self._refresh()

    def done(self, result: ItemResult) -> None:
        with self.lock:
            self.finished += 1
            self.running.pop(self._label(result.item), None)
            if self.enabled:
                self._echo(_result_line(result, self.finished, self.total))
                details = _details(result)
                if details:
                    self._echo("\n".join(f"    {line}" for line in details))
            self._refresh()

    def _echo(self, text: str) -> None:
        if self.status is not None:
            self.status.console.print(text, markup=False, highlight=False)
        else:
            click.echo(text, err=True)


@contextmanager
def _progress(total: int, enabled: bool) -> Iterator[_Shown]:
    if not enabled or not sys.stderr.isatty():
        yield _Shown(total, enabled, None)
        return
    from rootstock.cli.common import console

    with console(stderr=True).status(f"[0/{total}] starting") as status:
        yield _Shown(total, enabled, status)


_MARKS = {"done": "ok  ", "failed": "FAIL", "skipped": "skip"}


def _result_line(result: ItemResult, position: int, total: int) -> str:
    item = result.item
    line = f"[{position}/{total}] {_MARKS[result.status]} {item.phase} {item.key}"
    if result.status != "skipped":
        line += f" ({result.seconds:.1f} s)"
    # A failure's message is the summary's line for it (_render_summary): said once.
    if result.message and result.status == "skipped":
        line += f": {result.message}"
    return line


def _details(result: ItemResult) -> list[str]:
    """The lines of a failure's output that its message, in the summary, does not say.

    The output of an error starts with the error's own message, which the summary's
    line already carries; what follows (uv's or the worker's last lines) is said
    only here.
    """
    if result.status != "failed":
        return []
    lines = (result.output or "").splitlines()
    message = result.message or ""
    while lines and (not lines[0].strip() or lines[0].strip() in message):
        lines.pop(0)
    return lines


def _render_plan(report: SyncReport) -> None:
    """The dry run, terraform-style: one line per item, the notes, the counts."""
    prepared = report.prepared
    plan = prepared.plan
    cluster = prepared.state.cluster or "(no cluster: nothing verified)"
    click.echo(
        f"sync plan for {prepared.source.label} (cluster {cluster}, device {prepared.device}); "
        "dry run: nothing is built, fetched or verified"
    )
    if plan.items:
        click.echo("")
    for item in plan.items:
        click.echo(f"{item.symbol} {item.phase} {item.key} ({item.reason})")
        for problem in item.blocked:
            click.echo(f"    {problem}")
    for note in plan.notes:
        click.echo(f"  note: {note}")
    click.echo("")
    click.echo(_plan_line(plan, prepared.source.label))


def _plan_line(plan: SyncPlan, source: str) -> str:
    if not plan.items:
        return f"Plan: nothing to do; the install matches {source}."
    counts = plan.counts()
    blocked = sum(bool(item.blocked) for item in plan.items)
    builds = f"{counts['build']} to build" + (f" ({blocked} cannot start)" if blocked else "")
    return f"Plan: {builds}, {counts['download']} to download, {counts['verify']} to verify."


def _render_summary(report: SyncReport) -> None:
    """Counts, each failure with its phase and reason, and the way forward."""
    prepared = report.prepared
    for note in prepared.plan.notes:
        click.echo(f"note: {note}", err=True)
    if not report.results:
        click.echo(f"nothing to do: the install matches {prepared.source.label}")
        return
    counts = report.counts()
    click.echo(
        f"sync: {counts['done']} done, {counts['failed']} failed, {counts['skipped']} skipped"
    )
    failures = report.failures()
    if failures:
        click.echo("failed:")
        for result in failures:
            click.echo(f"  {result.item.phase} {result.item.key}: {result.message}")
        from rootstock.ops.sync import RERUN_HINT

        click.echo(f"  hint: {RERUN_HINT}")
