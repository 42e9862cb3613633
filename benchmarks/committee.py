"""Benchmark: a committee of models (issue #35) against its members alone.

On 64 rattled 8-atom Cu cells, on the CPU, for a committee of 2 and of 3 members:

  single  one structure at a time (energy, forces and stress from one request each):
          the committee's wall time against its slowest member alone and against the
          sum of its members alone;
  batch   ``calculate_batch(images, batch_size=16)``, the same two ratios.

Members: CHGNet-0.3.0 + EMT, then + the null model (tests/envs/null_model.py).
Without CHGNet (``--no-chgnet``, or no CHGNet build): EMT + shifted EMT
(tests/envs/shifted_emt.py: EMT with its energy shifted and its forces scaled by
1.01), then + the null model. Each member alone is a RootstockCalculator; the
committee's members share those workers (the same processes, taking turns), so the
ratios compare the same model processes with and without the committee around them.
The configurations take turns (five; one with ``--quick``), and every timing is the
best of its turns.

Target: a single-call committee time <= 1.2x its slowest member alone (whose time
includes its own round trip) on a machine with a core per member. Each worker runs
one thread (``--threads``), and the verdict is given only where ``os.cpu_count()``
is at least the number of members (with fewer cores the members queue, and the time
tends to the sum) and the load average before the timed turns is at most the core
count (the machine is not busy with other work). Timings are printed, never asserted.

    python benchmarks/committee.py [--quick] [--json] [--root ROOT] [--no-chgnet]

The envs are built by real uv into throughput.py's persistent root (``--build-dir``,
default ``$ROOTSTOCK_BENCH_DIR`` or ``~/.cache/rootstock-bench/throughput``), with
the shifted EMT env added when CHGNet is not used; rebuilt only when an env file or
this checkout's rootstock changed. A CHGNet build that fails or outlasts
``--build-timeout`` in quick mode leaves an EMT-family report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import batched, print_table, single_calls
from _throughput_setup import (
    ENV_FILES,
    REPO,
    build_root,
    default_build_dir,
    private_workspace,
    worker_pids,
)

CHGNET, EMT, SHIFTED_EMT, NULL = "chgnet-0.3.0", "emt", "shifted-emt", "null"
# _throughput_setup builds the envs this table names (env name: file); shifted-emt is
# the committee tests' own env.
ENV_FILES.setdefault(SHIFTED_EMT, REPO / "tests" / "envs" / "shifted_emt.py")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
TARGET = 1.2  # single-call committee time / slowest member alone, a core per member


# --- the root -------------------------------------------------------------------------------


def prepare_root(args: argparse.Namespace, quick: bool, work: Path) -> tuple[Path, bool, str]:
    """(the root, whether CHGNet is there, a note for the report).

    ``--root`` is used as given, never built into; otherwise the envs are built into
    the persistent root, CHGNet last and, in quick mode, allowed to fail.
    """
    if args.root:
        root = Path(args.root)
        chgnet = not args.no_chgnet and (root / "envs" / "chgnet").exists()
        needed = [EMT, NULL] + ([] if chgnet else [SHIFTED_EMT])
        missing = [name for name in needed if not (root / "envs" / name).exists()]
        if missing:
            raise SystemExit(f"--root {root} has no {', '.join(missing)} env")
        return root, chgnet, "" if chgnet or args.no_chgnet else f"no chgnet env in {root}"
    root = Path(args.build_dir) if args.build_dir else default_build_dir()
    build_root(root, [EMT, NULL], work, {})
    note = "CHGNet skipped (--no-chgnet)"
    if not args.no_chgnet:
        timeout = args.build_timeout or (300.0 if quick else 2400.0)
        try:
            build_root(root, ["chgnet"], work, {"chgnet": timeout})
            return root, True, ""
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            if not quick:
                raise
            first = str(exc).strip().splitlines()[0]
            note = f"CHGNet not built within {timeout:.0f} s ({first}): EMT family only"
    build_root(root, [SHIFTED_EMT], work, {})
    return root, False, note


# --- structures and calls -------------------------------------------------------------------


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


# --- the measurement ------------------------------------------------------------------------


def measure(
    root: Path, members: list[str], sizes: list[int], images: list[Any], batch_size: int,
    repeats: int,
) -> dict[str, Any]:  # fmt: skip
    """Every member alone and every committee (its first ``n`` members for each ``n`` in
    ``sizes``), single calls and ``calculate_batch``, taking turns; best of ``repeats``."""
    from rootstock import CommitteeCalculator, RootstockCalculator

    with contextlib.ExitStack() as stack:
        start = time.perf_counter()
        alone = {
            m: stack.enter_context(RootstockCalculator(m, root=root, device="cpu")) for m in members
        }
        committees = {
            n: stack.enter_context(CommitteeCalculator(members[:n], root=root, device="cpu"))
            for n in sizes
        }
        runs: dict[tuple[str, Any], Any] = {}
        for label, calc in [*alone.items(), *committees.items()]:
            runs[("single", label)] = lambda c=calc: single_calls(c, images)
            runs[("batch", label)] = lambda c=calc: batched(c, images, batch_size)
        for calc in [*alone.values(), *committees.values()]:  # start-up and warm-up
            single_calls(calc, images[:2])
            calc.calculate_batch(images[:batch_size], batch_size=batch_size)
        warm_up_s = time.perf_counter() - start
        workers = len(worker_pids())
        best: dict[tuple[str, Any], float] = {}
        energies: dict[tuple[str, Any], list[float]] = {}
        for _ in range(repeats):
            for key, run in runs.items():
                seconds, energies[key] = run()
                best[key] = min(best.get(key, seconds), seconds)
    results = []
    for n in sizes:
        entry: dict[str, Any] = {"members": members[:n]}
        for mode in ("single", "batch"):
            alone_s = {m: best[(mode, m)] for m in members[:n]}
            committee_s = best[(mode, n)]
            slowest = max(alone_s, key=alone_s.__getitem__)
            entry[mode] = {
                "committee_s": committee_s,
                "members_s": alone_s,
                "slowest": slowest,
                "vs_slowest": committee_s / alone_s[slowest],
                "vs_sum": committee_s / sum(alone_s.values()),
            }
        mean = [
            sum(values) / n
            for values in zip(*(energies[("single", m)] for m in members[:n]), strict=True)
        ]
        entry["max_energy_diff_eV"] = max(
            abs(a - b)
            for mode in ("single", "batch")
            for a, b in zip(energies[(mode, n)], mean, strict=True)
        )
        results.append(entry)
    return {"warm_up_s": warm_up_s, "workers": workers, "committees": results}


def leftover_workers(wait_s: float = 10.0) -> int:
    """The worker processes of this run still alive once they had ``wait_s`` to exit."""
    deadline = time.monotonic() + wait_s
    while worker_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(worker_pids())


# --- main ------------------------------------------------------------------------------------


def set_threads(threads: int | None) -> str:
    """Give every worker ``threads`` threads (default 1, unless the environment says)."""
    if threads is not None:
        for name in THREAD_VARIABLES:
            os.environ[name] = str(threads)
    else:
        for name in THREAD_VARIABLES:
            os.environ.setdefault(name, "1")
    return os.environ["OMP_NUM_THREADS"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one turn, not five (CI)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument("--root", help="an install with the emt, null and chgnet envs built")
    parser.add_argument("--build-dir", help="the persistent root to build the envs into")
    parser.add_argument("--no-chgnet", action="store_true", help="EMT-family members only")
    parser.add_argument("--build-timeout", type=float, help="seconds for the CHGNet build")
    parser.add_argument("--threads", type=int, help="threads per worker (default 1)")
    args = parser.parse_args()
    count, batch_size, repeats = 64, 16, (1 if args.quick else 5)

    results: dict[str, Any] = {
        "quick": args.quick,
        "cpu_count": os.cpu_count(),
        "threads": set_threads(args.threads),
        "structures": count,
        "batch_size": batch_size,
        "repeats": repeats,
    }
    start = time.perf_counter()
    with private_workspace("rootstock-bench-committee-") as work:
        root, chgnet, results["note"] = prepare_root(args, args.quick, work)
        members = [CHGNET, EMT, NULL] if chgnet else [EMT, SHIFTED_EMT, NULL]
        results["load_before"] = os.getloadavg()[0]
        results.update(measure(root, members, [2, 3], rattled_cells(count), batch_size, repeats))
        results["load_after"] = os.getloadavg()[0]
        results["leftover_workers"] = leftover_workers()
    results["wall_s"] = time.perf_counter() - start
    if args.json:
        print(json.dumps(results, indent=2))
        return
    report(results)


def _verdict(ratio: float, members: int, cores: int | None, load: float) -> tuple[str, str]:
    """(the target, whether it is met): judged only with a core per member, idle."""
    if cores is None or cores < members:
        return f"<= {TARGET} with a core per member", f"n/a ({members} members, {cores} cores)"
    if load > cores:
        return f"<= {TARGET}", f"n/a (load average {load:.1f} on {cores} cores)"
    return f"<= {TARGET}", "yes" if ratio <= TARGET else "NO"


def report(results: dict[str, Any]) -> None:
    """One table per committee size, then the target with its verdict."""
    if results.get("note"):
        print(f"note: {results['note']}")
    cores = results["cpu_count"]
    print(
        f"\n{results['structures']} rattled Cu8 cells, batch size {results['batch_size']}, "
        f"os.cpu_count()={cores}, {results['threads']} thread(s) per worker, "
        f"best of {results['repeats']} turn(s), load average {results['load_before']:.1f} "
        f"before and {results['load_after']:.1f} after"
    )
    load = results["load_before"]  # the load after includes this run's own workers
    if cores is not None and load > cores:
        print("(a load above os.cpu_count(): other processes compete, so no ratio is judged)")
    targets: list[tuple[str, ...]] = []
    for entry in results["committees"]:
        members = entry["members"]
        rows = []
        for mode in ("single", "batch"):
            run = entry[mode]
            alone = ", ".join(f"{m} {s:.3f}" for m, s in run["members_s"].items())
            rows.append(
                (
                    mode,
                    f"{run['committee_s']:.3f}",
                    alone,
                    f"{run['vs_slowest']:.2f}",
                    f"{run['vs_sum']:.2f}",
                )
            )
        header = ("calls", "committee s", "members alone s", "x slowest", "x sum")
        print_table(f"committee of {len(members)}: {' + '.join(members)}", rows, header)
        print(f"max |E_committee - mean of members alone| = {entry['max_energy_diff_eV']:.1e} eV")
        target, meets = _verdict(entry["single"]["vs_slowest"], len(members), cores, load)
        measured = f"{entry['single']['vs_slowest']:.2f}"
        targets.append((f"{len(members)} members, single, x slowest", measured, target, meets))
    print_table("targets", targets)
    leftover = results["leftover_workers"]
    print(
        f"\n{results['workers']} worker processes (the committees share the members'); "
        f"{leftover} left after closing; start-up and warm-up {results['warm_up_s']:.1f} s; "
        f"wall {results['wall_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
