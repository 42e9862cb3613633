"""Shared helpers for the benchmarks: timing, tables, quick mode.

Benchmarks report ratios measured side by side in one run. They never assert:
these machines are too noisy for a timing to fail a build.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def timed(func: Callable[[], object]) -> float:
    """Wall time of one call, in seconds."""
    start = time.perf_counter()
    func()
    return time.perf_counter() - start


def run(cmd: Sequence[str], env: dict | None = None, timeout: float = 900) -> None:
    """Run a command, raising with its output if it fails."""
    proc = subprocess.run(
        list(map(str, cmd)),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}")


def median(values: list[float]) -> float:
    return statistics.median(values)


def print_table(
    title: str,
    rows: list[tuple[str, ...]],
    header: tuple[str, ...] = ("metric", "measured", "target", "meets"),
) -> None:
    """Rows of (what, measured, target, verdict), or of the columns ``header`` names."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))


def sha256(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def write_built_env(
    root: Path, name: str, index: int, source: str, stamp: str, versions: dict
) -> dict:
    """A fake built env: ``envs/<name>`` with its source and build metadata, and the
    registered source. Returns the build record that verifications point at."""
    env_dir = root / "envs" / name
    env_dir.mkdir()
    (env_dir / "env_source.py").write_text(source)
    (root / "environments" / f"{name}.py").write_text(source)
    build = {
        "build_id": f"build-{index:02d}",
        "source_hash": sha256(source),
        "built_at": stamp,
        "lock_hash": sha256(name),
    }
    metadata = {
        **build,
        "name": name,
        "locked": True,
        "interpreter": {"path": sys.executable, "source": "local"},
        "versions": versions,
    }
    (env_dir / "rootstock-env.json").write_text(json.dumps(metadata))
    return build


def single_calls(calc: Any, images: list[Any]) -> tuple[float, list[float]]:
    """Seconds for energy, forces and stress of each structure in turn (one call each,
    stress asked for last), and the energies."""
    energies = []
    start = time.perf_counter()
    for atoms in images:
        atoms.calc = calc
        energies.append(atoms.get_potential_energy())
        atoms.get_forces()
        atoms.get_stress()
    elapsed = time.perf_counter() - start
    for atoms in images:
        atoms.calc = None
    return elapsed, energies


def batched(calc: Any, images: list[Any], batch_size: int) -> tuple[float, list[float]]:
    """Seconds for one ``calculate_batch`` over ``images``, and the energies."""
    start = time.perf_counter()
    results = calc.calculate_batch(images, batch_size=batch_size)
    elapsed = time.perf_counter() - start
    return elapsed, [r["energy"] for r in results]
