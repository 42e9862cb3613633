"""``rootstock smoke-test``: re-verify every fetched checkpoint, recording each result
the moment it is known.

Each result is one short locked write of its own manifest record, so a run killed
at its wall-time limit keeps every stamp it reached. Nothing is downloaded.

Before each forward pass the checkpoint's weight files are compared with what
``add`` recorded (size and mtime; every file re-hashed with ``rehash``): a changed
file records ``tampered`` and the model is not run (:mod:`rootstock.ops.integrity`).

A broken env (its ``env_source.py`` does not parse) is not skipped: each fetched
id the manifest recorded for it is stamped ``failed`` with ``file:line: message``,
first, without starting a worker (every spawn of it would fail the same way).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rootstock.errors import UsageError
from rootstock.install.envfile import EnvFile
from rootstock.install.envs import scan_installed_envs
from rootstock.install.layout import InstallLayout
from rootstock.install.machine import resolve_cluster
from rootstock.install.manifest import load_manifest, record_verification
from rootstock.install.perms import maintainer_umask
from rootstock.ops.checkpoints import (
    broken_build,
    broken_checkpoints,
    check_selection,
    fetched_checkpoints,
)
from rootstock.ops.verify import DEFAULT_VERIFY_TIMEOUT, verify_and_record


@dataclass
class SmokeResult:
    """One checkpoint's re-verification."""

    env: str
    checkpoint: str
    device: str
    state: str
    seconds: float
    message: str | None = None
    # The physics checks of this verification (docs/manifest.md), None if none ran.
    checks: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        """True when the re-verification was recorded as ``verified``."""
        return self.state == "verified"

    def to_dict(self) -> dict[str, Any]:
        """One entry of ``smoke-test --json``'s ``results``."""
        return {
            "env": self.env,
            "checkpoint": self.checkpoint,
            "device": self.device,
            "state": self.state,
            "seconds": round(self.seconds, 3),
            "message": self.message,
            "checks": self.checks,
        }


@dataclass
class SmokeReport:
    """Every result of one smoke-test run."""

    cluster: str
    results: list[SmokeResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every checkpoint tested passed (and when none was tested)."""
        return all(r.passed for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        """The ``smoke-test --json`` document (docs/automated-testing.md)."""
        counts: dict[str, int] = {}
        for result in self.results:
            counts[result.state] = counts.get(result.state, 0) + 1
        return {
            "cluster": self.cluster,
            "ok": self.ok,
            "counts": counts,
            "results": [r.to_dict() for r in self.results],
        }


def device_slots(device: str, jobs: int) -> list[str]:
    """One device per concurrent job: ``cuda`` goes round the GPUs ``cuda:0..N-1``."""
    if device in ("cuda", "xpu") and jobs > 1:
        return [f"{device}:{i}" for i in range(jobs)]
    return [device] * jobs


def smoke_test(
    layout: InstallLayout,
    *,
    cluster: str | None = None,
    env: str | None = None,
    checkpoint: str | None = None,
    device: str = "cuda",
    verify_timeout: float = DEFAULT_VERIFY_TIMEOUT,
    jobs: int = 1,
    on_start: Callable[[int], None] = lambda _n: None,
    on_result: Callable[[SmokeResult], None] = lambda _r: None,
    snapshot_every: int | None = None,
    on_snapshot: Callable[[int], None] = lambda _n: None,
    rehash: bool = False,
) -> SmokeReport:
    """Re-verify every fetched checkpoint served on this cluster; never download.

    ``rehash`` re-hashes every recorded weight file before its forward pass (by
    default only those whose size or mtime changed).

    ``on_snapshot(done)`` is called after every ``snapshot_every`` results (not
    after the last one: the caller's final push covers it). It runs while results
    are serialized, so it must return quickly (``--push-every`` only queues a push).
    """
    if snapshot_every is not None and snapshot_every < 1:
        raise UsageError("--push-every must be at least 1")
    if jobs < 1:
        raise UsageError("--jobs must be at least 1")
    check_selection(layout, cluster, env, checkpoint)
    manifest = load_manifest(layout)
    machine = resolve_cluster(layout, cluster, manifest)
    found = scan_installed_envs(layout)
    selected = fetched_checkpoints(layout, manifest, machine, env, checkpoint, found)
    broken = broken_checkpoints(found, env, checkpoint)
    total = len(broken) + len(selected)
    report = SmokeReport(machine)
    on_start(total)
    slots: queue.Queue[str] = queue.Queue()
    for slot in device_slots(device, jobs):
        slots.put(slot)
    report_lock = threading.Lock()

    @contextmanager
    def lend_slot() -> Iterator[str]:
        slot = slots.get()
        try:
            yield slot
        finally:
            slots.put(slot)

    def verify_one(item: tuple[EnvFile, str]) -> None:
        env_file, checkpoint_id = item
        verified = verify_and_record(
            layout,
            env_file,
            checkpoint_id,
            machine,
            device=lend_slot,
            kwargs=None,
            timeout=verify_timeout,
            recheck=True,
            rehash=rehash,
        )
        outcome, record = verified.outcome, verified.record
        result = SmokeResult(
            env_file.name,
            checkpoint_id,
            outcome.device,
            record["state"],
            outcome.seconds,
            record.get("message"),
            outcome.checks,
        )
        add_result(result)

    def add_result(result: SmokeResult) -> None:
        with report_lock:
            report.results.append(result)
            on_result(result)
            done = len(report.results)
            if snapshot_every and done % snapshot_every == 0 and done < total:
                on_snapshot(done)

    # Like add and install: the manifest it rewrites must stay group-writable.
    with maintainer_umask():
        for broken_env, checkpoint_id in broken:
            outcome = {
                "passed": False,
                "device": device,
                "message": broken_env.message,
                "build": broken_build(layout, broken_env),
            }
            record = record_verification(layout, broken_env.name, checkpoint_id, machine, outcome)
            add_result(
                SmokeResult(
                    broken_env.name, checkpoint_id, device, record["state"], 0.0, record["message"]
                )
            )
        if jobs == 1:
            for item in selected:
                verify_one(item)
        else:
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                for future in [pool.submit(verify_one, item) for item in selected]:
                    future.result()
    return report
