"""Benchmark: a worker's first energy from a shared filesystem that is slow on purpose (issue #30).

For EMT and CHGNet-0.3.0 (EMT only in ``--quick`` mode or with ``--no-chgnet``), on
the CPU, on an 8-atom Cu cell:

- **warm local**: the root on local disk, after one start to warm the page cache;
- **cold slowfs**: the same root through ``scripts/dev/slowfs-up`` (every metadata
  operation waits ``--latency-ms``, reads are paced to ``--read-mbps``, the kernel
  caches nothing), on a fresh mount for each start;
- for both, the time from ``RootstockCalculator(...)`` to the first energy, and the
  phases of a start (interpreter, imports, ``setup()``, first call) measured by
  ``_cold_start_env.py`` in the env's own Python (``--quick``, CI's smoke run, leaves
  out the cold phases);
- on slowfs, the operations (by kind) and bytes that one calculator's start made
  the filesystem serve.

Then, with the build's image (``install`` packs one by default), workers started from a
node-local stage (``_cold_start_staged.py``): the first on a node, a later one, staging
alone, and ``--nodes`` K nodes at once.

Timings are printed, never asserted.

    python benchmarks/cold_start.py [--quick] [--json] [--root ROOT] [--no-chgnet]
                                    [--latency-ms 1] [--read-mbps 50] [--runs N]
                                    [--modes mount,copy] [--nodes 4] [--no-cold-phases]

The envs are built by real uv into the persistent root that ``benchmarks/throughput.py``
uses (``--build-dir``, default ``$ROOTSTOCK_BENCH_DIR`` or
``~/.cache/rootstock-bench/throughput``), rebuilt only when an env file or this
checkout's rootstock changed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table
from _throughput_setup import prepare_root, private_workspace

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).resolve().parent / "_cold_start_env.py"
SLOWFS_UP = REPO / "scripts" / "dev" / "slowfs-up"
SLOWFS_DOWN = REPO / "scripts" / "dev" / "slowfs-down"
CHGNET, EMT = "chgnet-0.3.0", "emt"
PHASES = ("interpreter", "imports", "setup", "first_call")


# --- the slow filesystem ------------------------------------------------------------------


@contextlib.contextmanager
def slowfs(source: Path, mount: Path, latency_ms: float, read_mbps: float) -> Iterator[Path]:
    """``source`` mounted at ``mount`` through slowfs for the duration of the block."""
    options = ["--latency-ms", str(latency_ms), "--read-mbps", str(read_mbps)]
    up = subprocess.run(
        [str(SLOWFS_UP), str(source), str(mount), *options],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    if up.returncode != 0:
        raise RuntimeError(f"slowfs-up failed:\n{up.stdout}{up.stderr}")
    try:
        yield mount
    finally:
        down = subprocess.run(
            [str(SLOWFS_DOWN), str(mount)], capture_output=True, text=True, timeout=300
        )
        if down.returncode != 0:
            subprocess.run(["fusermount3", "-uz", str(mount)], check=False, timeout=60)


def counts(mount: Path) -> dict[str, Any]:
    return json.loads((mount / ".slowfs-stats").read_text())


def difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    kinds = sorted(set(after["ops"]) | set(before["ops"]))
    ops = {k: after["ops"].get(k, 0) - before["ops"].get(k, 0) for k in kinds}
    return {
        "ops": {k: n for k, n in ops.items() if n},
        "metadata_ops": after["metadata_ops"] - before["metadata_ops"],
        "bytes_read": after["bytes_read"] - before["bytes_read"],
    }


# --- one start, two ways --------------------------------------------------------------------


def cell() -> Any:
    from ase.build import bulk

    return bulk("Cu", "fcc", a=3.6, cubic=True).repeat((1, 1, 2))


def first_energy(root: Path | str, checkpoint: str, stage: str = "off") -> tuple[float, float]:
    """(seconds from the constructor to the first energy, the energy), a fresh worker
    started as ``stage`` says (``off``: from the shared env, as before images)."""
    from rootstock import RootstockCalculator

    atoms = cell()
    start = time.perf_counter()
    with RootstockCalculator(
        checkpoint, root=root, device="cpu", shared=False, stage=stage
    ) as calc:
        atoms.calc = calc
        energy = float(atoms.get_potential_energy())
        elapsed = time.perf_counter() - start
    return elapsed, energy


def phases(root: Path, checkpoint: str) -> dict[str, float]:
    """The phases of a start, in the env's own Python with a worker's environment."""
    from rootstock.runtime.spec import WorkerOptions, resolve_worker_spec
    from rootstock.runtime.worker_env import worker_environment

    spec = resolve_worker_spec(checkpoint, WorkerOptions(root, device="cpu"))
    env = worker_environment(spec.layout, spec.env_name, offline=True)
    argv = [str(spec.python), "-I", str(PROBE), str(spec.env_source), spec.checkpoint, "cpu"]
    done = subprocess.run(
        [*argv, repr(time.time())],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the in-env probe failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(run[name] for run in runs) for name in PHASES}


def measure(root: Path, checkpoint: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Warm local and cold slowfs, side by side, for one checkpoint."""
    print(f"{checkpoint}: warm-up start on local disk ...", file=sys.stderr)
    first_energy(root, checkpoint)
    phases(root, checkpoint)
    local = [first_energy(root, checkpoint) for _ in range(args.runs)]
    local_phases = [phases(root, checkpoint) for _ in range(args.runs)]
    cold: list[tuple[float, float]] = []
    cold_phases: list[dict[str, float]] = []
    served: dict[str, Any] = {}
    for run in range(args.runs):
        print(f"{checkpoint}: cold start {run + 1}/{args.runs} on slowfs ...", file=sys.stderr)
        with slowfs(
            root, work / f"slowfs-{checkpoint}-{run}", args.latency_ms, args.read_mbps
        ) as m:
            before = counts(m)
            cold.append(first_energy(m, checkpoint))
            served = difference(counts(m), before)
        if args.quick or args.no_cold_phases:
            continue  # the end-to-end start and its counts only
        with slowfs(
            root, work / f"slowfs-{checkpoint}-{run}p", args.latency_ms, args.read_mbps
        ) as m:
            cold_phases.append(phases(m, checkpoint))
    energies = {round(e, 10) for _, e in local + cold}
    staged = None
    if args.modes:
        from _cold_start_staged import measure_staged

        env = checkpoint.split("-")[0]
        warm = statistics.median(s for s, _ in local)
        staged = measure_staged(root, checkpoint, env, work, args, warm)
        energies |= {e for mode in args.modes for e in staged[mode]["energies"]}
    return {
        "local_warm_s": statistics.median(s for s, _ in local),
        "slowfs_cold_s": statistics.median(s for s, _ in cold),
        "local_warm_phases": median_phases(local_phases),
        "slowfs_cold_phases": median_phases(cold_phases) if cold_phases else None,
        "slowfs_one_start": served,
        "staged": staged,
        "same_energy": len(energies) == 1,
    }


# --- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="EMT only, one start each, no cold phases (CI)"
    )
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument("--root", help="an install with the emt (and chgnet) envs built")
    parser.add_argument("--build-dir", help="the persistent root to build the envs into")
    parser.add_argument("--no-chgnet", action="store_true", help="EMT only")
    parser.add_argument(
        "--no-cold-phases",
        action="store_true",
        help="skip the phases of the unstaged cold start (a second cold start each)",
    )
    parser.add_argument("--build-timeout", type=float, help="seconds for the CHGNet build")
    parser.add_argument("--latency-ms", type=float, default=1.0)
    parser.add_argument("--read-mbps", type=float, default=50.0)
    parser.add_argument("--runs", type=int, help="starts of each kind (default 3; 1 in --quick)")
    parser.add_argument(
        "--modes",
        default=None,
        help="stage modes to measure, comma-separated, or 'none' (default mount,copy; "
        "mount in --quick)",
    )
    parser.add_argument(
        "--nodes", type=int, help="simulated nodes starting at once (default 4; 0 in --quick)"
    )
    args = parser.parse_args()
    args.runs = args.runs or (1 if args.quick else 3)
    modes = args.modes or ("mount" if args.quick else "mount,copy")
    args.modes = [] if modes == "none" else [m.strip() for m in modes.split(",") if m.strip()]
    args.nodes = args.nodes if args.nodes is not None else (0 if args.quick else 4)
    if args.quick:
        args.no_chgnet = True

    results: dict[str, Any] = {
        "quick": args.quick,
        "latency_ms": args.latency_ms,
        "read_mbps": args.read_mbps,
        "runs": args.runs,
    }
    with private_workspace("rootstock-bench-cold-start-") as work:
        root, chgnet, note = prepare_root(args, args.quick, work)
        results["note"] = note
        models = [EMT, CHGNET] if chgnet else [EMT]
        results["models"] = {m: measure(root, m, work, args) for m in models}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    report(results)


def report(results: dict[str, Any]) -> None:
    if results.get("note"):
        print(f"note: {results['note']}")
    print(
        f"slowfs: {results['latency_ms']:g} ms per metadata operation, reads at "
        f"{results['read_mbps']:g} MB/s; median of {results['runs']} start(s) each"
    )
    for model, r in results["models"].items():
        rows = [
            (
                "first energy, s",
                f"{r['local_warm_s']:.2f}",
                f"{r['slowfs_cold_s']:.2f}",
                f"{r['slowfs_cold_s'] / r['local_warm_s']:.1f}x",
            ),
        ]
        cold = r["slowfs_cold_phases"] or {}
        for name in PHASES:
            a, b = r["local_warm_phases"][name], cold.get(name)
            ratio = f"{b / a:.1f}x" if a and b is not None else "n/a"
            rows.append((f"  {name}, s", f"{a:.2f}", "n/a" if b is None else f"{b:.2f}", ratio))
        served = r["slowfs_one_start"]
        rows.append(("metadata operations (one start)", "", str(served["metadata_ops"]), ""))
        rows.append(("MB read (one start)", "", f"{served['bytes_read'] / 1e6:.1f}", ""))
        header = ("", "warm local", "cold slowfs", "ratio")
        print_table(f"{model}: time to first energy", rows, header)
        print(f"  operations by kind: {served['ops']}")
        if r.get("staged"):
            from _cold_start_staged import report_staged

            report_staged(model, r["staged"], r["slowfs_cold_s"], r["local_warm_s"])
        if not r["same_energy"]:
            print("  WARNING: the energies differ between starts")


if __name__ == "__main__":
    main()
