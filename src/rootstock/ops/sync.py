"""``rootstock sync``: converge an install to the env files of a SOURCE.

Three steps, each usable on its own (the CLI interleaves its permission check and
dashboard decision between them):

1. :func:`finish_pending_prune_if_any`: a journal an interrupted ``prune`` left is
   carried out first, under the root lock;
2. :func:`prepare_sync`: one read of the install (:func:`read_install_state`), the
   SOURCE files parsed with the install lint, the names on the command line checked,
   and the pure planner (:mod:`rootstock.ops.sync_plan`) run. Nothing runs uv or
   starts a worker up to here, so a converged install costs about one ``status``;
3. :func:`execute_plan`: the phases in order, build, download, verify. Builds and
   downloads run in a pool of ``jobs``, verifications in one of ``verify_jobs``
   with round-robin devices (``smoke-test --jobs``'s slots). Every stamp is written
   the moment it is known (by ``install_one``, ``record_fetch`` and
   ``record_verification``), so a killed sync keeps what it reached.

A failure never stops the others by default: a failed build skips that env's
downloads and verifies, a failed download skips its verify, and each skip is
reported with its reason. ``fail_fast`` cancels everything not yet started.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rootstock.errors import RootstockError, SourceError, UsageError
from rootstock.install.dry_run import read_for_plan
from rootstock.install.envfile import EnvFile
from rootstock.install.envs import load_installed_env, read_env_metadata, scan_installed_envs
from rootstock.install.layout import InstallLayout
from rootstock.install.machine import resolve_cluster
from rootstock.install.manifest import Manifest, device_kind, load_manifest
from rootstock.install.perms import maintainer_umask
from rootstock.install.prune_journal import CarriedOut, finish_pending_prune
from rootstock.ops.sources import EnvSource
from rootstock.ops.sync_plan import (
    PHASES,
    BuiltEnv,
    InstallState,
    PlanItem,
    RejectedFile,
    SyncOptions,
    SyncPlan,
    check_scope,
    plan_sync,
)

# The summary's last line: a sync is idempotent, so the fix is always the same.
RERUN_HINT = "re-run the same sync after fixing; completed work is skipped"
# ops.verify's and ops.add's defaults. What builds, fetches and verifies is imported
# only when a plan runs, so that a no-op sync loads no more than ``status`` does.
DEFAULT_VERIFY_TIMEOUT = 600.0
DEFAULT_DOWNLOAD_TIMEOUT = 3600.0


@dataclass(frozen=True)
class SyncRun:
    """How the plan is carried out (none of this changes what is planned)."""

    device: str = "cuda"
    verify_timeout: float = DEFAULT_VERIFY_TIMEOUT
    download_timeout: float = DEFAULT_DOWNLOAD_TIMEOUT
    jobs: int = 4
    verify_jobs: int = 1
    fail_fast: bool = False
    upgrade: bool = False
    #: Pack images of the builds: None follows the root (``images`` in layout.json).
    image: bool | None = None
    #: Re-hash every recorded weight file before each verification (``--rehash``).
    rehash: bool = False


@dataclass
class ItemResult:
    """What became of one plan item: ``done``, ``failed`` or ``skipped`` (and why).

    ``output`` is the whole error text (uv's or the worker's tail) of a failure,
    shown only for failures; ``message`` is its one-line summary.
    """

    item: PlanItem
    status: str
    seconds: float = 0.0
    message: str | None = None
    output: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """One entry of ``results`` in ``sync --json`` (docs/cli.md)."""
        return {
            "phase": self.item.phase,
            "env": self.item.env,
            "checkpoint": self.item.checkpoint,
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "message": self.message,
            "output": self.output,
        }


@dataclass
class PreparedSync:
    """An opened SOURCE, the state it was planned against, and the plan."""

    source: EnvSource
    state: InstallState
    plan: SyncPlan
    device: str


@dataclass
class SyncReport:
    """Everything ``sync --json`` prints (docs/cli.md)."""

    prepared: PreparedSync
    dry_run: bool
    results: list[ItemResult] = field(default_factory=list)
    pending_prune: CarriedOut | None = None

    @property
    def ok(self) -> bool:
        """True when no item failed (a dry run, and nothing to do, are ok)."""
        return not any(r.status == "failed" for r in self.results)

    def counts(self) -> dict[str, int]:
        """Results by status (every status named, zeros included)."""
        return {s: sum(r.status == s for r in self.results) for s in ("done", "failed", "skipped")}

    def failures(self) -> list[ItemResult]:
        """The failed items, in the order they finished."""
        return [r for r in self.results if r.status == "failed"]

    def to_dict(self) -> dict[str, Any]:
        """The ``sync --json`` document."""
        pending = self.pending_prune
        return {
            "source": self.prepared.source.to_dict(),
            "cluster": self.prepared.state.cluster,
            "device": self.prepared.device,
            "dry_run": self.dry_run,
            "pending_prune": None
            if pending is None
            else {"deleted": pending.deleted, "spared": pending.spared},
            "plan": self.prepared.plan.to_dict(),
            "results": [r.to_dict() for r in self.results],
            "counts": self.counts(),
            "ok": self.ok,
        }


@dataclass
class SyncHooks:
    """What the caller hears while a plan runs (each called from a pool thread).

    ``on_item_done`` and ``on_snapshot`` are called one at a time; ``on_snapshot(n)``
    after every ``snapshot_every`` results, not after the last (the final push
    covers it), and must return quickly (``--push-every`` only queues a push).
    """

    on_item_start: Callable[[PlanItem], None] = lambda _item: None
    on_item_step: Callable[[PlanItem, str], None] = lambda _item, _msg: None
    on_item_done: Callable[[ItemResult], None] = lambda _result: None
    snapshot_every: int | None = None
    on_snapshot: Callable[[int], None] = lambda _n: None


def parse_phases(value: Any) -> tuple[str, ...]:
    """``--phases build,verify`` as a tuple in the canonical order; UsageError if unknown."""
    if isinstance(value, tuple):
        return value  # click converts a default (or a converted value) again
    names = [part.strip().lower() for part in str(value).split(",") if part.strip()]
    unknown = [n for n in names if n not in PHASES]
    if unknown or not names:
        raise UsageError(
            f"unknown phase {unknown[0]!r}" if unknown else "no phase given",
            hint=f"give a comma-separated subset of {','.join(PHASES)}",
        )
    return tuple(p for p in PHASES if p in names)


def finish_pending_prune_if_any(layout: InstallLayout) -> CarriedOut | None:
    """Carry out the journal an interrupted prune left (under the root lock); None if none."""
    if not layout.prune_journal.exists():
        return None
    from rootstock.install.build import root_lock

    with maintainer_umask(), root_lock(layout):
        return finish_pending_prune(layout)


def read_install_state(
    layout: InstallLayout,
    cluster: str | None,
    device: str,
    *,
    verifying: bool,
    rehash: bool = False,
    scope: SyncOptions | None = None,
) -> InstallState:
    """One read of everything the planner looks at: no uv, no worker.

    The cluster is resolved as ``add`` does when ``verifying`` (a shared install
    needs ``--cluster``); otherwise a cluster that cannot be told is None. When
    ``verifying``, the recorded weight files of each checkpoint in ``scope`` (its
    ``--env`` and ``--checkpoint``; all when None) are stat'ed (``rehash``: read and
    hashed in full), so a changed one is planned for verification.
    """
    from rootstock.version import __version__

    manifest = load_manifest(layout)
    if verifying or cluster:
        machine: str | None = resolve_cluster(layout, cluster, manifest)
    else:
        try:
            machine = resolve_cluster(layout, None, manifest)
        except UsageError:
            machine = None  # a shared install: builds and downloads serve every cluster
    found = scan_installed_envs(layout)
    weights_changed = (
        _weights_changed(layout, manifest, rehash, scope or SyncOptions())
        if verifying
        else frozenset()
    )
    envs: dict[str, BuiltEnv] = {}
    for env in found.envs:
        meta = read_env_metadata(layout, env.name) or {}
        envs[env.name] = BuiltEnv(
            env.name,
            meta.get("source_hash"),
            env.source_hash,
            tuple(env.checkpoints),
            tuple(env.clusters) if env.clusters is not None else None,
            (meta.get("versions") or {}).get("rootstock"),
        )
    for broken in found.broken:
        meta = read_env_metadata(layout, broken.name) or {}
        envs[broken.name] = BuiltEnv(
            broken.name,
            meta.get("source_hash"),
            broken.live_source_hash(),
            broken.recorded_ids,
            None,
            (meta.get("versions") or {}).get("rootstock"),
            broken=broken.message,
        )
    return InstallState(
        manifest=manifest,
        envs=envs,
        cluster=machine,
        device_kind=device_kind(device),
        rootstock_version=__version__,
        pending_prune=layout.prune_journal.exists(),
        weights_changed=weights_changed,
    )


def _weights_changed(
    layout: InstallLayout, manifest: Manifest, rehash: bool, scope: SyncOptions
) -> frozenset[tuple[str, str]]:
    """``(env, id)`` of each checkpoint whose recorded weight files changed size or
    mtime (a stat each; ``rehash``: size or sha256, every file read), or that a worker
    start marked for re-verification."""
    from rootstock.install.weights import (
        check_weights,
        marked_for_reverification,
        stat_mismatches,
    )

    changed = set()
    for env_name, env in manifest.get("envs", {}).items():
        if scope.envs and env_name not in scope.envs:
            continue  # out of scope: never read (--rehash would hash it all)
        for checkpoint, entry in (env.get("checkpoints") or {}).items():
            weights = entry.get("weights")
            if not weights or (scope.checkpoints and checkpoint not in scope.checkpoints):
                continue
            if rehash:
                differs = not check_weights(layout.cache_root, weights, rehash=True).ok
            else:
                differs = bool(stat_mismatches(layout.cache_root, weights))
            if differs or marked_for_reverification(layout, env_name, checkpoint):
                changed.add((env_name, checkpoint))
    return frozenset(changed)


def read_declared(source: EnvSource) -> tuple[list[EnvFile], list[RejectedFile]]:
    """Parse every env file of ``source`` with the install lint: the good and the rejected."""
    if not source.files:
        raise SourceError(f"SOURCE {source.label} holds no env files (*.py)")
    declared: list[EnvFile] = []
    rejected: list[RejectedFile] = []
    for path in source.files:
        env, problems = read_for_plan(path)
        if env is None or problems:
            rejected.append(RejectedFile(env.name if env else path.stem, path, tuple(problems)))
        else:
            declared.append(env)
    return declared, rejected


def prepare_sync(
    layout: InstallLayout,
    source: EnvSource,
    options: SyncOptions,
    *,
    cluster: str | None = None,
    device: str = "cuda",
    rehash: bool = False,
) -> PreparedSync:
    """Read the install and ``source``, check the names, and plan (no uv, no worker).

    ``rehash`` hashes every recorded weight file, so a changed one is planned for
    verification even when its size and mtime are as recorded (``sync --rehash``).
    """
    declared, rejected = read_declared(source)
    state = read_install_state(
        layout,
        cluster,
        device,
        verifying="verify" in options.phases,
        rehash=rehash,
        scope=options,
    )
    check_scope(declared, rejected, state, options, source.label)
    plan = plan_sync(state, declared, options, rejected)
    return PreparedSync(source, state, plan, device)


def execute_plan(
    layout: InstallLayout, prepared: PreparedSync, run: SyncRun, hooks: SyncHooks | None = None
) -> list[ItemResult]:
    """Carry out ``prepared.plan`` phase by phase; one result per item, in finishing order."""
    executor = _Executor(layout, prepared, run, hooks or SyncHooks())
    if not prepared.plan.items:
        return []
    with maintainer_umask():
        executor.run()
    return executor.results


def sync(
    layout: InstallLayout,
    source: EnvSource,
    options: SyncOptions,
    run: SyncRun | None = None,
    *,
    cluster: str | None = None,
    dry_run: bool = False,
    hooks: SyncHooks | None = None,
) -> SyncReport:
    """The whole of ``rootstock sync`` against an opened SOURCE, without printing."""
    run = run or SyncRun()
    pending = None if dry_run else finish_pending_prune_if_any(layout)
    prepared = prepare_sync(
        layout, source, options, cluster=cluster, device=run.device, rehash=run.rehash
    )
    report = SyncReport(prepared, dry_run, pending_prune=pending)
    if not dry_run:
        report.results = execute_plan(layout, prepared, run, hooks)
    return report


class _Executor:
    """The phases of one plan, their pools, and what a failure makes others skip."""

    def __init__(
        self, layout: InstallLayout, prepared: PreparedSync, run: SyncRun, hooks: SyncHooks
    ) -> None:
        self.layout = layout
        self.plan = prepared.plan
        self.cluster = prepared.state.cluster
        self.run_options = run
        self.hooks = hooks
        self.results: list[ItemResult] = []
        self.total = len(self.plan.items)
        self.lock = threading.Lock()
        self.cancelled = threading.Event()
        self.failed_builds: dict[str, str] = {}
        self.failed_downloads: set[tuple[str, str | None]] = set()
        self.slots: queue.Queue[str] = queue.Queue()
        from rootstock.ops.smoke import device_slots

        for slot in device_slots(run.device, run.verify_jobs):
            self.slots.put(slot)

    def run(self) -> None:
        builds = self.plan.phase_items("build")
        if any(not item.blocked for item in builds):
            for directory in (
                self.layout.environments_dir,
                self.layout.envs_dir,
                self.layout.locks_dir,
            ):
                directory.mkdir(parents=True, exist_ok=True)
            from rootstock.ops.install import sweep_stale_staging

            sweep_stale_staging(self.layout)
        self._pool(builds, self._build, self.run_options.jobs)
        self._pool(self.plan.phase_items("download"), self._download, self.run_options.jobs)
        self._pool(self.plan.phase_items("verify"), self._verify, self.run_options.verify_jobs)

    def _pool(
        self, items: list[PlanItem], work: Callable[[PlanItem], ItemResult], jobs: int
    ) -> None:
        if not items:
            return
        if jobs == 1:
            for item in items:
                self._one(item, work)
            return
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for future in [pool.submit(self._one, item, work) for item in items]:
                future.result()

    def _one(self, item: PlanItem, work: Callable[[PlanItem], ItemResult]) -> None:
        skipped = self._skip_reason(item)
        if skipped is not None:
            self._finish(ItemResult(item, "skipped", message=skipped))
            return
        self.hooks.on_item_start(item)
        start = time.monotonic()
        try:
            result = work(item)
        except RootstockError as exc:
            result = ItemResult(item, "failed", message=_summary(exc), output=str(exc))
        except OSError as exc:  # a full disk, a permission: this item's, not the run's
            result = ItemResult(item, "failed", message=str(exc), output=str(exc))
        result.seconds = time.monotonic() - start
        self._finish(result)

    def _skip_reason(self, item: PlanItem) -> str | None:
        if self.cancelled.is_set():
            return "cancelled (--fail-fast: an earlier item failed)"
        if item.phase != "build" and item.env in self.failed_builds:
            return f"the build of {item.env} failed"
        if item.phase == "verify" and (item.env, item.checkpoint) in self.failed_downloads:
            return f"the download of {item.key} failed"
        return None

    def _finish(self, result: ItemResult) -> None:
        with self.lock:
            if result.status == "failed":
                if result.item.phase == "build":
                    self.failed_builds[result.item.env] = result.message or "failed"
                elif result.item.phase == "download":
                    self.failed_downloads.add((result.item.env, result.item.checkpoint))
                if self.run_options.fail_fast:
                    self.cancelled.set()
            self.results.append(result)
            self.hooks.on_item_done(result)
            done = len(self.results)
            every = self.hooks.snapshot_every
            if every and done % every == 0 and done < self.total:
                self.hooks.on_snapshot(done)

    def _build(self, item: PlanItem) -> ItemResult:
        if item.blocked or item.path is None:
            return ItemResult(
                item, "failed", message=f"{item.path} {item.reason}", output="\n".join(item.blocked)
            )
        from rootstock.install.build import BuildOptions
        from rootstock.ops.install import install_one

        outcome = install_one(
            self.layout,
            item.path,
            item.force,
            BuildOptions(upgrade=self.run_options.upgrade, image=self.run_options.image),
            None,
            lambda message: self.hooks.on_item_step(item, message),
        )
        return ItemResult(item, "done", message="; ".join(outcome.all_notes) or None)

    def _download(self, item: PlanItem) -> ItemResult:
        assert item.checkpoint is not None  # the planner gives every download an id
        env = load_installed_env(self.layout, item.env)
        kwargs = dict(env.verify_kwargs.get(item.checkpoint, {}))
        from rootstock.ops.add import fetch_and_record

        fetch_and_record(
            self.layout, item.env, item.checkpoint, kwargs, self.run_options.download_timeout
        )
        return ItemResult(item, "done")

    def _verify(self, item: PlanItem) -> ItemResult:
        assert item.checkpoint is not None and self.cluster is not None  # the planner's rule
        env = load_installed_env(self.layout, item.env)
        from rootstock.ops.verify import verify_and_record

        verified = verify_and_record(
            self.layout,
            env,
            item.checkpoint,
            self.cluster,
            device=self._lend_slot,
            kwargs=None,
            timeout=self.run_options.verify_timeout,
            recheck=True,
            rehash=self.run_options.rehash,
        )
        state = verified.record["state"]
        if state == "verified":
            return ItemResult(item, "done", message=f"verified on {verified.outcome.device}")
        message = f"{state}: {verified.record.get('message') or 'no reason recorded'}"
        if state == "drifted":
            message += f" (accept it with `rootstock add {item.checkpoint} --accept-drift`)"
        return ItemResult(item, "failed", message=message, output=verified.outcome.message)

    @contextmanager
    def _lend_slot(self) -> Iterator[str]:
        slot = self.slots.get()
        try:
            yield slot
        finally:
            self.slots.put(slot)


def _summary(exc: RootstockError) -> str:
    """One line for a failure: its first line, plus the last line naming an error in
    the whole text (a worker's traceback ends with the model's ``RuntimeError: ...``)."""
    lines = [line.strip() for line in exc.message.splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    for line in reversed(str(exc).splitlines()):
        line = line.strip()
        if ("Error" in line or "Exception" in line or line.startswith("error:")) and line:
            return first if line in first else f"{first}: {line}"
    return first
