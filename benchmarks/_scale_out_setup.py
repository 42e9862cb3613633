"""What ``benchmarks/scale_out.py`` stands on: the persistent root (with the counting
EMT env added), the Rootstock workers of a run found in /proc, and the SLURM jobs a
run submitted, so that none outlives it."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _throughput_setup import REPO, _install, _stale, build_root, default_build_dir

#: EMT that appends a line to its ``count_file`` on every setup(): the EMT runs'
#: model loads are counted by the model itself, not only by worker processes.
COUNT_EMT = REPO / "tests" / "envs" / "count_emt.py"


def build_count_emt(root: Path, work: Path) -> None:
    """Build ``count-emt`` into ``root`` unless it is there, from this checkout."""
    from rootstock.install.vendor import build_wheel_bytes

    version = build_wheel_bytes()[0].split("-")[1]
    source = COUNT_EMT.read_text()
    if not _stale(root, "count-emt", source, version):
        return
    staging = work / "scale-out-env-files"
    staging.mkdir(exist_ok=True)
    env_file = staging / "count-emt.py"  # the env takes its name from the file
    env_file.write_text(source)
    print(f"building count-emt into {root} ...", file=sys.stderr)
    _install(root, env_file, (root / "envs" / "count-emt").exists(), [], 600)


def prepare_root(args: argparse.Namespace, quick: bool, work: Path) -> tuple[Path, bool, str]:
    """(the root, whether CHGNet is there, a note for the report).

    The root is throughput.py's (``--build-dir``, default
    ``~/.cache/rootstock-bench/throughput``), so CHGNet is built once for both.
    """
    if args.root:  # used as given, never built into
        root = Path(args.root)
        if not (root / "envs" / "count-emt").exists():
            raise SystemExit(f"--root {root} has no count-emt env (tests/envs/count_emt.py)")
    else:
        root = Path(args.build_dir or default_build_dir())
        build_root(root, [], work, {})  # creates the root, as throughput.py does
        build_count_emt(root, work)
    if quick or args.no_chgnet:
        return root, False, "EMT only (quick mode)" if quick else "CHGNet skipped (--no-chgnet)"
    if not args.root:
        build_root(root, ["chgnet"], work, {"chgnet": args.build_timeout or 2400.0})
    if not (root / "envs" / "chgnet").exists():
        return root, False, f"no chgnet env in {root}: EMT only"
    return root, True, ""


# --- the Rootstock workers of a run ---------------------------------------------------------


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def rootstock_workers(env_dir: Path) -> dict[int, dict[str, str | None]]:
    """Every live ``python -m rootstock.worker`` of the env at ``env_dir``, by pid.

    Found across the whole machine (a SLURM job's processes are slurmd's children,
    not ours) by the ``VIRTUAL_ENV`` Rootstock gives each worker of an env. Only
    this run's root is matched, so other users of the machine are not counted.
    Each value records the worker's thread variables.
    """
    found: dict[int, dict[str, str | None]] = {}
    target = str(env_dir)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"rootstock.worker" not in argv:
                continue
            environ = _environ(pid)
        except OSError:
            continue
        if environ.get("VIRTUAL_ENV") == target:
            found[pid] = {
                "OMP_NUM_THREADS": environ.get("OMP_NUM_THREADS"),
                "CUDA_VISIBLE_DEVICES": environ.get("CUDA_VISIBLE_DEVICES"),
            }
    return found


# --- SLURM jobs -----------------------------------------------------------------------------


def parsl_jobs(dfk: Any) -> list[str]:
    """The SLURM job ids of a loaded Parsl config's blocks."""
    jobs: list[str] = []
    for executor in dfk.executors.values():
        provider = getattr(executor, "provider", None)
        jobs += [str(j) for j in getattr(provider, "resources", {}) or {}]
    return jobs


def dask_jobs(client: Any) -> list[str]:
    """The SLURM job ids of a dask-jobqueue cluster's jobs."""
    cluster = getattr(client, "cluster", None)
    workers = getattr(cluster, "workers", {}) or {}
    return [str(j.job_id) for j in workers.values() if getattr(j, "job_id", None)]


def queued(jobs: set[str]) -> list[str]:
    """Those of ``jobs`` that squeue still lists."""
    if not jobs:
        return []
    proc = subprocess.run(
        ["squeue", "-h", "-j", ",".join(sorted(jobs)), "-o", "%i"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return [line.strip() for line in proc.stdout.splitlines() if line.strip() in jobs]


def end_jobs(jobs: set[str], wait: float = 30.0) -> str:
    """Wait for this run's jobs to leave the queue, scancel those that do not; ""
    when none was left, else what had to be cancelled."""
    deadline = time.monotonic() + wait
    left = queued(jobs)
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = queued(jobs)
    if not left:
        return ""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(["scancel", *left], capture_output=True, timeout=30, check=False)
    return f"scancelled SLURM job(s) {', '.join(left)} that outlived their engine's shutdown"
