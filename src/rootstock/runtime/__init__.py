"""The client side of a worker: spec, spawn, session, calculator, batch, pool, stage.

This package's face is the names below, and nothing outside ``runtime/`` imports
one of its modules (``tests/unit/test_import_rules.py`` checks it). Each name loads
its module on first access, so importing ``rootstock.runtime`` loads none of them:
a caller pays only for the names it uses, and the CLI's ``--help`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Each exported name -> (the module that defines it, its name there).
_FACE: dict[str, tuple[str, str]] = {
    # The calculator, and how a worker is asked for and resolved.
    "RootstockCalculator": ("calculator", "RootstockCalculator"),
    # Several checkpoints at once, their spread, and the watch on it.
    "CommitteeCalculator": ("committee", "CommitteeCalculator"),
    "UncertaintyExceeded": ("committee_watch", "UncertaintyExceeded"),
    "watch_committee": ("committee_watch", "watch"),
    "WorkerOptions": ("spec", "WorkerOptions"),
    "WorkerSpec": ("spec", "WorkerSpec"),
    "resolve_worker_spec": ("spec", "resolve_worker_spec"),
    "worker_key": ("worker_keys", "worker_key"),
    # Starting processes that run a model (spawn.py is the only place they start).
    "spawn_worker": ("spawn", "spawn_worker"),
    "spawn_env_script": ("spawn", "spawn_env_script"),
    "run_download": ("spawn", "run_download"),
    "DownloadFailed": ("download_failure", "DownloadFailed"),
    "describe_exit": ("session", "describe_exit"),
    "FORWARDED_ARRAYS": ("session", "FORWARDED_ARRAYS"),
    "make_private_dir": ("server", "make_private_dir"),
    # What produced a calculator's results, and the lockfile readers behind it.
    "Provenance": ("provenance", "Provenance"),
    "build_provenance": ("provenance", "build_provenance"),
    "read_env_lock": ("provenance", "read_env_lock"),
    "resolved_versions": ("provenance", "resolved_versions"),
    # Many structures through one worker.
    "calculate_batch": ("batch", "calculate_batch"),
    "plan_batch": ("batch", "plan_batch"),
    "stream_batch": ("batch", "stream_batch"),
    "run_chunk": ("batch", "run_chunk"),
    "BatchPlan": ("batch", "BatchPlan"),
    "Outcome": ("batch", "Outcome"),
    "DEFAULT_PROPERTIES": ("batch", "DEFAULT_PROPERTIES"),
    # The user's pool of warm workers (rootstock workers).
    "ensure_daemon": ("pool.client", "ensure_daemon"),
    "clean_if_dead": ("pool.client", "clean_if_dead"),
    "DEFAULT_IDLE_TIMEOUT": ("pool.daemon", "DEFAULT_IDLE_TIMEOUT"),
    "PoolFiles": ("pool.directory", "PoolFiles"),
    "PoolFileError": ("pool.directory", "PoolFileError"),
    "ensure_pool_dir": ("pool.directory", "ensure_pool_dir"),
    "read_pool_json": ("pool.directory", "read_json"),
    "read_states": ("pool.directory", "read_states"),
    "daemon_alive": ("pool.directory", "daemon_alive"),
    # Node-local stages of a build (rootstock stage).
    "stage_mode": ("stage", "stage_mode"),
    "stage_image": ("stage", "stage_image"),
    "build_image": ("stage", "build_image"),
    "StagedEntry": ("stage_dir", "StagedEntry"),
    "StageRefused": ("stage_dir", "StageRefused"),
    "list_stages": ("stage_dir", "list_stages"),
    "clean_stages": ("stage_dir", "clean_stages"),
}

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_PROPERTIES",
    "FORWARDED_ARRAYS",
    "BatchPlan",
    "CommitteeCalculator",
    "DownloadFailed",
    "Outcome",
    "PoolFileError",
    "PoolFiles",
    "Provenance",
    "RootstockCalculator",
    "StageRefused",
    "StagedEntry",
    "UncertaintyExceeded",
    "WorkerOptions",
    "WorkerSpec",
    "build_image",
    "build_provenance",
    "calculate_batch",
    "clean_if_dead",
    "clean_stages",
    "daemon_alive",
    "describe_exit",
    "ensure_daemon",
    "ensure_pool_dir",
    "list_stages",
    "make_private_dir",
    "plan_batch",
    "read_env_lock",
    "read_pool_json",
    "read_states",
    "resolve_worker_spec",
    "resolved_versions",
    "run_chunk",
    "run_download",
    "spawn_env_script",
    "spawn_worker",
    "stage_image",
    "stage_mode",
    "stream_batch",
    "watch_committee",
    "worker_key",
]

if TYPE_CHECKING:
    from rootstock.runtime.batch import (
        DEFAULT_PROPERTIES,
        BatchPlan,
        Outcome,
        calculate_batch,
        plan_batch,
        run_chunk,
        stream_batch,
    )
    from rootstock.runtime.calculator import RootstockCalculator
    from rootstock.runtime.committee import CommitteeCalculator
    from rootstock.runtime.committee_watch import UncertaintyExceeded
    from rootstock.runtime.committee_watch import watch as watch_committee
    from rootstock.runtime.download_failure import DownloadFailed
    from rootstock.runtime.pool.client import clean_if_dead, ensure_daemon
    from rootstock.runtime.pool.daemon import DEFAULT_IDLE_TIMEOUT
    from rootstock.runtime.pool.directory import (
        PoolFileError,
        PoolFiles,
        daemon_alive,
        ensure_pool_dir,
        read_states,
    )
    from rootstock.runtime.pool.directory import read_json as read_pool_json
    from rootstock.runtime.provenance import (
        Provenance,
        build_provenance,
        read_env_lock,
        resolved_versions,
    )
    from rootstock.runtime.server import make_private_dir
    from rootstock.runtime.session import FORWARDED_ARRAYS, describe_exit
    from rootstock.runtime.spawn import run_download, spawn_env_script, spawn_worker
    from rootstock.runtime.spec import WorkerOptions, WorkerSpec, resolve_worker_spec
    from rootstock.runtime.stage import build_image, stage_image, stage_mode
    from rootstock.runtime.stage_dir import StagedEntry, StageRefused, clean_stages, list_stages
    from rootstock.runtime.worker_keys import worker_key


def __getattr__(name: str) -> Any:
    # Looked up at every access, never cached here: a test that patches the defining
    # module's name is seen by code that imports it from this face at call time.
    if name not in _FACE:
        raise AttributeError(f"module 'rootstock.runtime' has no attribute {name!r}")
    module, attr = _FACE[name]
    return getattr(importlib.import_module(f"rootstock.runtime.{module}"), attr)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
