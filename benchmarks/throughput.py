"""Benchmark: batched evaluation and warm workers (issue #16), measured side by side.

On 64 (``--quick``, chunks of 16) or 256 (chunks of 64) rattled 8-atom Cu cells, on
the CPU, in structures/s:

  (i)   single calls through RootstockCalculator (energy, forces, stress each);
  (ii)  ``calc.calculate_batch(images, batch_size=B)``;
  (iii) the model's own batched call in its env's Python (CHGNet:
        ``predict_structure(structures, batch_size=B)``; EMT has none);
  (iv)  the model's own loop in its env's Python, one structure at a time.

Targets for CHGNet: (ii) >= 0.9x (iii) and (ii) >= 1.5x (i). EMT is reported too.
Also: the per-structure cost of (ii) against (i) with a null model at 8 atoms
(target: >= 5x lower); warm attach, from ``RootstockCalculator(..., pool=True)``
to the first CHGNet energy against a cold start (target: <= 0.2 s and >= 50x
faster); and the total worker RSS of 7 calculators sharing one worker against 7
unshared ones (CHGNet; EMT in quick mode).

Chunk sizes: the worker's peak RSS over a batch for fixed chunk sizes beside
``batch_size="auto"``, with the worker's default budget and with a small
``max_memory``, and whether auto's model calls stayed within their budget (the
worker's memory report). On tests/envs/memory_emt.py (EMT whose batched call holds
512 KiB per atom, standing in for a model whose memory grows with its batch), and
on CHGNet outside quick mode.

Timings are printed, never asserted.

    python benchmarks/throughput.py [--quick] [--json] [--root ROOT] [--no-chgnet]

The envs (environments/emt.py, environments/chgnet.py, tests/envs/null_model.py,
tests/envs/memory_emt.py) are built by real uv into a persistent root (``--build-dir``, default
``$ROOTSTOCK_BENCH_DIR`` or ``~/.cache/rootstock-bench/throughput``), rebuilt only
when an env file or this checkout's rootstock changed. In quick mode a CHGNet
build that fails or outlasts ``--build-timeout`` leaves an EMT-only report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _chunk_memory import chunk_memory, report_chunk_memory
from _common import batched, print_table, single_calls
from _throughput_setup import (
    InEnvModel,
    prepare_root,
    private_workspace,
    worker_pids,
    worker_rss_mb,
)

CHGNET, EMT, NULL, MEMORY_EMT = "chgnet-0.3.0", "emt", "null", "memory-emt"
SHARERS = 7
# memory-emt's batched call holds this much per atom: 4 MiB per 8-atom cell.
MEMORY_EMT_COSTS = {"bytes_per_atom": 512 << 10}


def chunk_sizes(fixed: list[int], small_budget: str) -> list[tuple[Any, Any]]:
    """``(batch_size, max_memory)`` pairs: the fixed sizes, then auto twice."""
    return [(n, None) for n in fixed] + [("auto", None), ("auto", small_budget)]


# --- structures ---------------------------------------------------------------------------


def rattled_cells(count: int) -> list[Any]:
    """``count`` fcc Cu 2x2x2 primitive cells (8 atoms), each rattled 0.05 Å by its seed."""
    from ase.build import bulk

    base = bulk("Cu", "fcc", a=3.6) * (2, 2, 2)
    images = []
    for seed in range(count):
        atoms = base.copy()
        atoms.rattle(0.05, seed=seed)
        images.append(atoms)
    return images


def save_cells(images: list[Any], path: Path) -> Path:
    """The structures as arrays, so the in-env runs see exactly the same ones."""
    import numpy as np

    np.savez(
        path,
        numbers=np.array([a.numbers for a in images]),
        positions=np.array([a.positions for a in images]),
        cells=np.array([a.cell.array for a in images]),
    )
    return path


def calculator(root: Path, checkpoint: str, **kwargs: Any) -> Any:
    """A RootstockCalculator on the CPU: unshared and unpooled unless ``kwargs`` say."""
    from rootstock import RootstockCalculator

    options = {"shared": False, "pool": False, **kwargs}
    return RootstockCalculator(checkpoint, root=root, device="cpu", **options)


# --- (i) and (ii) are _common.single_calls and _common.batched; the first energy -------


def first_energy(root: Path, checkpoint: str, atoms: Any, **kwargs: Any) -> tuple[float, Any]:
    """(seconds from the constructor to the first energy, the calculator)."""
    atoms = atoms.copy()
    start = time.perf_counter()
    calc = calculator(root, checkpoint, **kwargs)
    atoms.calc = calc
    atoms.get_potential_energy()
    return time.perf_counter() - start, calc


def throughput(
    root: Path, checkpoint: str, images: list[Any], cells: Path, batch_size: int, repeats: int
) -> dict[str, Any]:
    """(i)-(iv) for one checkpoint, taking turns, best of ``repeats``; and a cold start."""
    cold_s, calc = first_energy(root, checkpoint, images[0])
    best: dict[str, float | None] = {"i": None, "ii": None, "iii": None, "iv": None}
    energies: dict[str, list[float]] = {}
    try:
        single_calls(calc, images[:2])  # stress is computed from its first request on
        calc.calculate_batch(images[:4], batch_size=batch_size)  # warm the batch path
        with InEnvModel(calc.spec, cells) as own:
            runs = {
                "i": lambda: single_calls(calc, images),
                "ii": lambda: batched(calc, images, batch_size),
                "iv": own.loop,
            }
            if own.batched is not None:
                runs["iii"] = lambda: own.batch(batch_size)
            for _ in range(repeats):
                for key, run in runs.items():
                    seconds, energies[key] = run()
                    previous = best[key]
                    best[key] = seconds if previous is None else min(previous, seconds)
            setup_s, own_batched = own.setup_s, own.batched
    finally:
        calc.close()
    reference = energies["iv"]
    spread = max(
        abs(a - b) for key in energies for a, b in zip(energies[key], reference, strict=True)
    )
    return {
        "checkpoint": checkpoint,
        "structures": len(images),
        "batch_size": batch_size,
        "per_s": {k: (len(images) / v if v else None) for k, v in best.items()},
        "own_batched_call": own_batched,
        "max_energy_diff_eV": spread,
        "cold_first_energy_s": cold_s,
        "in_env_setup_s": setup_s,
    }


# --- null-model overhead ---------------------------------------------------------------------


def null_overhead(root: Path, images: list[Any], batch_size: int, repeats: int) -> dict[str, float]:
    """Microseconds per structure: (i) and (ii) through the null model, and in-process."""
    import importlib.util

    from rootstock.runtime.spec import WorkerOptions, resolve_worker_spec

    spec = resolve_worker_spec(NULL, WorkerOptions(root, device="cpu"))
    loader = importlib.util.spec_from_file_location("bench_null_model", spec.env_source)
    module = importlib.util.module_from_spec(loader)  # type: ignore[arg-type]
    loader.loader.exec_module(module)  # type: ignore[union-attr]
    in_process = module.make_null_calculator()
    _, calc = first_energy(root, NULL, images[0])
    best = {"i": float("inf"), "ii": float("inf"), "in_process": float("inf")}
    try:
        batched(calc, images[:batch_size], batch_size)
        for _ in range(repeats):
            best["i"] = min(best["i"], single_calls(calc, images)[0])
            best["ii"] = min(best["ii"], batched(calc, images, batch_size)[0])
            best["in_process"] = min(best["in_process"], single_calls(in_process, images)[0])
    finally:
        calc.close()
    return {k: v / len(images) * 1e6 for k, v in best.items()}


# --- sharing and the pool --------------------------------------------------------------------


def sharing_memory(root: Path, checkpoint: str, atoms: Any) -> dict[str, Any]:
    """Workers and their total RSS for 7 calculators, sharing and then not sharing."""
    already = set(worker_pids())

    def measure(shared: bool) -> dict[str, Any]:
        calcs = []
        try:
            for _ in range(SHARERS):
                calcs.append(first_energy(root, checkpoint, atoms, shared=shared)[1])
            pids = [p for p in worker_pids() if p not in already]
            return {"workers": len(pids), "rss_mb": worker_rss_mb(pids)}
        finally:
            for calc in calcs:
                calc.close()

    return {"checkpoint": checkpoint, "shared": measure(True), "unshared": measure(False)}


def warm_attach(
    root: Path, checkpoint: str, atoms: Any, runs: int, cold: list[float]
) -> dict[str, Any]:
    """Seconds from ``RootstockCalculator(pool=True)`` to the first energy, pool pre-started."""
    prestart_s, first = first_energy(root, checkpoint, atoms, pool=True)
    first.close()  # the daemon outlives it, until its idle timeout
    times = []
    for _ in range(runs):
        seconds, calc = first_energy(root, checkpoint, atoms, pool=True)
        calc.close()
        times.append(seconds)
    return {
        "checkpoint": checkpoint,
        "prestart_s": prestart_s,
        "attach_s": statistics.median(times),
        "cold_s": statistics.median(cold),
        "runs": runs,
    }


def guarded(what: str, func: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """Run one section; an API that is missing or fails is reported, not fatal."""
    try:
        return func(*args)
    except Exception as exc:  # a benchmark reports what it could not measure
        print(f"warning: {what} not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {"error": f"{type(exc).__name__}: {exc}"}


# --- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 structures, fewer turns (CI)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument("--root", help="an install with the emt, null and chgnet envs built")
    parser.add_argument("--build-dir", help="the persistent root to build the envs into")
    parser.add_argument("--no-chgnet", action="store_true", help="EMT and the null model only")
    parser.add_argument("--build-timeout", type=float, help="seconds for the CHGNet build")
    args = parser.parse_args()
    quick = args.quick
    # CHGNet's batched call holds about 140 MB per 8-atom cell (its many periodic
    # images), so a chunk of 64 needs ~9 GB in the worker and as much again in the
    # in-env process: quick mode (CI) uses chunks of 16, the issue's smaller size.
    count, batch_size, repeats = (64, 16, 2) if quick else (256, 64, 3)
    null_count = 1000 if quick else 10_000
    attach_runs, cold_runs = (3, 1) if quick else (10, 3)

    results: dict[str, Any] = {"quick": quick, "threads": os.environ.get("OMP_NUM_THREADS")}
    with private_workspace("rootstock-bench-throughput-") as work:
        root, chgnet, note = prepare_root(args, quick, work)
        results["note"] = note
        images = rattled_cells(count)
        cells = save_cells(images, work / "cells.npz")
        models = [CHGNET, EMT] if chgnet else [EMT]
        results["throughput"] = {
            m: throughput(root, m, images, cells, batch_size, repeats) for m in models
        }
        results["null_overhead_us"] = null_overhead(root, rattled_cells(null_count), 64, repeats)
        big = CHGNET if chgnet and not quick else EMT
        results["sharing"] = guarded("sharing", sharing_memory, root, big, images[0])
        sections = [(MEMORY_EMT, chunk_sizes([4, 16, 64], "48MiB"), MEMORY_EMT_COSTS)]
        if chgnet and not quick:
            sections.append((CHGNET, chunk_sizes([4, 16, 64], "2GB"), {}))
        results["chunk_memory"] = [
            guarded("chunk memory", chunk_memory, root, model, images, sizes, setup)
            for model, sizes, setup in sections
        ]
        if chgnet:
            cold = [results["throughput"][CHGNET]["cold_first_energy_s"]]
            for _ in range(cold_runs - 1):
                seconds, calc = first_energy(root, CHGNET, images[0])
                calc.close()
                cold.append(seconds)
            results["attach"] = guarded(
                "warm attach", warm_attach, root, CHGNET, images[0], attach_runs, cold
            )
    if args.json:
        print(json.dumps(results, indent=2))
        return
    report(results)


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _verdict(ok: bool) -> str:
    return "yes" if ok else "NO"


def _meets(value: float | None, at_least: float) -> str:
    return "n/a" if value is None else _verdict(value >= at_least)


def report(results: dict[str, Any]) -> None:
    """The tables: throughput side by side, then every target with its verdict."""
    if results.get("note"):
        print(f"note: {results['note']}")
    runs = results["throughput"]
    first = next(iter(runs.values()))
    print(
        f"\nthroughput, structures/s ({first['structures']} rattled Cu8 cells, batch size "
        f"{first['batch_size']}, best of turns, OMP_NUM_THREADS={results['threads'] or 'unset'})"
    )
    print(
        f"{'model':<14}{'(i) single':>11}{'(ii) batch':>11}{'(iii) own batch':>16}"
        f"{'(iv) own loop':>14}{'ii/i':>7}{'ii/iii':>8}{'ii/iv':>7}{'max dE eV':>11}"
    )
    rows: list[tuple[str, str, str, str]] = []
    for name, run in runs.items():
        per = run["per_s"]
        print(
            f"{name:<14}{_fmt(per['i']):>11}{_fmt(per['ii']):>11}{_fmt(per['iii']):>16}"
            f"{_fmt(per['iv']):>14}{_fmt(_ratio(per['ii'], per['i']), '.2f'):>7}"
            f"{_fmt(_ratio(per['ii'], per['iii']), '.2f'):>8}"
            f"{_fmt(_ratio(per['ii'], per['iv']), '.2f'):>7}{run['max_energy_diff_eV']:>11.1e}"
        )
    if CHGNET in runs:
        per = runs[CHGNET]["per_s"]
        vs_own, vs_single = _ratio(per["ii"], per["iii"]), _ratio(per["ii"], per["i"])
        rows.append(
            ("CHGNet (ii)/(iii)", _fmt(vs_own, ".2f"), ">= 0.9", _verdict(vs_own and vs_own >= 0.9))
        )
        rows.append(
            (
                "CHGNet (ii)/(i)",
                _fmt(vs_single, ".2f"),
                ">= 1.5",
                _verdict(vs_single and vs_single >= 1.5),
            )
        )
    null = results["null_overhead_us"]
    lower = _ratio(null["i"], null["ii"])
    rows.append(
        (
            "null model, us/structure",
            f"(i) {null['i']:.0f}, (ii) {null['ii']:.1f} (in-process {null['in_process']:.1f})",
            "", "",
        )
    )  # fmt: skip
    rows.append(("null (i)/(ii)", _fmt(lower, ".1f"), ">= 5", _meets(lower, 5)))
    rows += _pool_rows(results)
    print_table("targets", rows)
    for section in results.get("chunk_memory", []):
        report_chunk_memory(section)
    print(
        "\n(i) RootstockCalculator single calls  (ii) calculate_batch  (iii) the model's own "
        "batched call in its env\n(iv) the model's own loop in its env; (iii) and (iv) include "
        "no Rootstock; max dE: largest energy difference of (i)-(iii) from (iv)"
    )


def _pool_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    attach = results.get("attach")
    if attach is None:
        rows.append(("warm attach", "not run (no CHGNet)", "", ""))
    elif "error" in attach:
        rows.append(("warm attach", f"not measured: {attach['error']}", "", ""))
    else:
        faster = attach["cold_s"] / attach["attach_s"]
        rows.append(
            (
                "warm attach, CHGNet",
                f"{attach['attach_s']:.3f} s (cold {attach['cold_s']:.1f} s)",
                "<= 0.2 s",
                _verdict(attach["attach_s"] <= 0.2),
            )
        )
        rows.append(("attach speed-up", f"{faster:.0f}x", ">= 50x", _verdict(faster >= 50)))
    sharing = results["sharing"]
    if "error" in sharing:
        rows.append(("sharing", f"not measured: {sharing['error']}", "", ""))
    else:
        shared, unshared = sharing["shared"], sharing["unshared"]
        rows.append(
            (
                f"{SHARERS} calculators, {sharing['checkpoint']}",
                f"shared: {shared['workers']} worker(s), {shared['rss_mb']:.0f} MB; "
                f"unshared: {unshared['workers']}, {unshared['rss_mb']:.0f} MB",
                "", "",
            )
        )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
