"""Benchmark: what the worker boundary costs per call, and at start-up.

A null model returns precomputed forces, so only the plumbing is timed. For 64,
864 and 4000 atoms, per call:

  (a) the null model in-process;
  (b) through RootstockCalculator (worker in the env's Python);
  (c) through ASE's SocketIOCalculator with a subprocess SocketClient;
  (d) a raw ping-pong of the same byte counts over a Unix socket (the floor).

Targets at 864 atoms: b-a <= 0.3 ms, b-a <= 0.25 (c-a), b-a <= 5 d.
Also time-to-first-energy for the EMT env against a bare subprocess of the env's
Python that imports ASE and computes once (target <= 1.3x).

Timings are printed, never asserted.

    python benchmarks/ipc_overhead.py [--quick] [--json] [--root ROOT] [--env-python PY]

Without ``--root`` the envs are faked in a temp root whose ``bin/python`` runs
``--env-python`` (default: this interpreter), as in the integration tests.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table

REPO = Path(__file__).resolve().parent.parent
NULL_ENV = REPO / "tests" / "envs" / "null_model.py"
EMT_ENV = REPO / "environments" / "emt.py"
SIZES = {64: (4, 4, 1), 864: (6, 6, 6), 4000: (10, 10, 10)}


# --- set-up -----------------------------------------------------------------------------


def fake_root(base: Path, python: str) -> Path:
    """A root with the null and EMT envs, each a bin/python wrapper around ``python``."""
    from rootstock.install.layout import write_layout

    root = base / "root"
    root.mkdir(parents=True)
    write_layout(root, None, images=False)  # hand-made envs: no image to stage
    for name, source in (("null", NULL_ENV), ("emt", EMT_ENV)):
        env = root / "envs" / name
        (env / "bin").mkdir(parents=True)
        shutil.copyfile(source, env / "env_source.py")
        wrapper = env / "bin" / "python"
        wrapper.write_text(f'#!/bin/sh\nexec {python} "$@"\n')
        wrapper.chmod(0o755)
    return root


def structure(natoms: int):
    from ase.build import bulk

    if natoms == 64:
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * SIZES[64]
    else:
        atoms = bulk("Cu", "fcc", a=3.6) * SIZES[natoms]
        if len(atoms) != natoms:
            atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * SIZES[natoms]
    atoms.rattle(0.01, seed=natoms)
    return atoms


def null_calculator():
    spec = importlib.util.spec_from_file_location("bench_null_model", NULL_ENV)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_null_calculator()


def calls_timer(atoms):
    """A function timing ``calls`` get_forces() on a structure that moves each call."""

    def measure(calls: int) -> float:
        start = time.perf_counter()
        for i in range(calls):
            atoms.positions[0, 0] += 1e-4 if i % 2 else -1e-4
            atoms.get_forces()
        return (time.perf_counter() - start) / calls

    measure(20)  # warm up (and start the worker, for b)
    return measure


# --- (a) in-process and (b) RootstockCalculator ------------------------------------------


@contextlib.contextmanager
def in_process(natoms: int):
    atoms = structure(natoms)
    atoms.calc = null_calculator()
    yield calls_timer(atoms)


@contextlib.contextmanager
def through_rootstock(natoms: int, root: Path):
    from rootstock import RootstockCalculator

    with RootstockCalculator(root=root, checkpoint="null", device="cpu") as calc:
        atoms = structure(natoms)
        atoms.calc = calc
        yield calls_timer(atoms)


# --- (c) ASE SocketIOCalculator ---------------------------------------------------------

SOCKETIO_CLIENT = """
import importlib.util, sys
from ase.calculators.socketio import SocketClient
from ase.io import read
spec = importlib.util.spec_from_file_location("null_model", sys.argv[1])
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
atoms = read(sys.argv[2]); atoms.calc = module.make_null_calculator()
SocketClient(unixsocket=sys.argv[3]).run(atoms, use_stress=False)
"""


@contextlib.contextmanager
def through_ase_socketio(natoms: int, work: Path, python: str):
    from ase.calculators.socketio import SocketIOCalculator
    from ase.io import write

    atoms = structure(natoms)
    name = f"rootstock-bench-{uuid.uuid4().hex[:10]}"
    xyz = work / f"socketio-{natoms}.xyz"
    write(xyz, atoms, format="extxyz")
    with SocketIOCalculator(unixsocket=name, timeout=120) as calc:
        client = subprocess.Popen(
            [python, "-c", SOCKETIO_CLIENT, str(NULL_ENV), str(xyz), name],
            start_new_session=True,
        )
        try:
            atoms.calc = calc
            yield calls_timer(atoms)
        finally:
            calc.close()
            client.wait(timeout=30)


# --- (d) raw ping-pong -------------------------------------------------------------------

PINGPONG_PEER = """
import socket, sys
path, request, reply = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sock = socket.socket(socket.AF_UNIX); sock.connect(path)
buf = bytearray(request); view = memoryview(buf); answer = bytes(reply)
while True:
    got = 0
    while got < request:
        n = sock.recv_into(view[got:])
        if n == 0:
            sys.exit(0)
        got += n
    sock.sendall(answer)
"""


@contextlib.contextmanager
def raw_pingpong(natoms: int, python: str):
    """The same byte counts as (b) each way, with no parsing at all."""
    request = 12 + 72 + 72 + 4 + 24 * natoms + 12  # POSDATA + GETFORCE
    reply = 12 + 8 + 4 + 24 * natoms + 72 + 4  # FORCEREADY
    run_dir = Path(tempfile.mkdtemp(prefix="rootstock-bench-"))
    path = str(run_dir / "pp.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    peer = subprocess.Popen([python, "-c", PINGPONG_PEER, path, str(request), str(reply)])
    try:
        conn, _ = server.accept()
        out = bytes(request)
        view = memoryview(bytearray(reply))

        def measure(calls: int) -> float:
            start = time.perf_counter()
            for _ in range(calls):
                conn.sendall(out)
                got = 0
                while got < reply:
                    got += conn.recv_into(view[got:])
            return (time.perf_counter() - start) / calls

        measure(20)
        yield measure
        conn.close()
    finally:
        server.close()
        peer.wait(timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)


def measure_size(natoms: int, root: Path, work: Path, python: str, calls: int, repeats: int):
    """Best-of-``repeats`` seconds per call for a-d, measured in turns.

    All four set-ups stay open and take turns, so a change in machine load during
    the run hits each of them alike.
    """
    with contextlib.ExitStack() as stack:
        timers = {
            "a": stack.enter_context(in_process(natoms)),
            "b": stack.enter_context(through_rootstock(natoms, root)),
            "c": stack.enter_context(through_ase_socketio(natoms, work, python)),
            "d": stack.enter_context(raw_pingpong(natoms, python)),
        }
        best = dict.fromkeys(timers, float("inf"))
        for _ in range(repeats):
            for key, measure in timers.items():
                best[key] = min(best[key], measure(calls))
    return best


# --- time to first energy ----------------------------------------------------------------

# The same structure, given literally: the user's script built it already, so
# neither side pays for ase.build.
BARE_FIRST_ENERGY = """
import json, sys
from ase import Atoms
from ase.calculators.emt import EMT
spec = json.loads(sys.argv[1])
atoms = Atoms(numbers=spec["numbers"], positions=spec["positions"], cell=spec["cell"], pbc=True)
atoms.calc = EMT()
print(atoms.get_potential_energy())
"""


def first_energy(root: Path, runs: int) -> tuple[float, float]:
    """Median seconds to the first EMT energy: through rootstock, and bare."""
    from ase.build import bulk

    from rootstock import RootstockCalculator

    python = str(root / "envs" / "emt" / "bin" / "python")

    def ours() -> float:
        atoms = bulk("Cu", "fcc", a=3.6) * (3, 3, 3)
        start = time.perf_counter()
        calc = RootstockCalculator(root=root, checkpoint="emt", device="cpu")
        atoms.calc = calc
        atoms.get_potential_energy()
        elapsed = time.perf_counter() - start
        calc.close()
        return elapsed

    atoms = bulk("Cu", "fcc", a=3.6) * (3, 3, 3)
    literal = json.dumps(
        {
            "numbers": atoms.numbers.tolist(),
            "positions": atoms.positions.tolist(),
            "cell": atoms.cell.tolist(),
        }
    )

    def bare() -> float:
        start = time.perf_counter()
        subprocess.run([python, "-c", BARE_FIRST_ENERGY, literal], check=True, capture_output=True)
        return time.perf_counter() - start

    bare(), ours()  # warm the page cache for both
    ours_times, bare_times = [], []
    for _ in range(runs):  # alternate, so drift in machine load hits both alike
        bare_times.append(bare())
        ours_times.append(ours())
    return statistics.median(ours_times), statistics.median(bare_times)


# --- main ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few calls and runs (CI)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument(
        "--root", help="an install with tests/envs/null_model.py and environments/emt.py"
    )
    parser.add_argument("--env-python", default=sys.executable)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rootstock-bench-ipc-"))
    os.environ.setdefault("ROOTSTOCK_CONFIG", str(work / "config.toml"))
    root = Path(args.root) if args.root else fake_root(work, args.env_python)
    calls = {64: 2000, 864: 1000, 4000: 300}
    repeats, ttfe_runs = 7, 5
    if args.quick:
        calls = {n: max(c // 10, 20) for n, c in calls.items()}
        repeats, ttfe_runs = 3, 1

    results: dict[str, dict] = {}
    try:
        for natoms in SIZES:
            best = measure_size(natoms, root, work, args.env_python, calls[natoms], repeats)
            results[str(natoms)] = {k: v * 1e6 for k, v in best.items()}  # microseconds
        ours, bare = first_energy(root, ttfe_runs)
        results["first_energy"] = {"rootstock_s": ours, "bare_s": bare}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    if args.json:
        print(json.dumps(results, indent=2))
        return
    report(results)


def report(results: dict[str, dict]) -> None:
    print("\nper-call time, microseconds (best-of mean)")
    print(
        f"{'atoms':>6} {'(a) inproc':>11} {'(b) rootstock':>14} {'(c) ase-socket':>15} "
        f"{'(d) floor':>10} {'b-a':>8} {'(b-a)/(c-a)':>12} {'(b-a)/d':>8}"
    )
    for natoms in SIZES:
        r = results[str(natoms)]
        over = r["b"] - r["a"]
        print(
            f"{natoms:>6} {r['a']:>11.1f} {r['b']:>14.1f} {r['c']:>15.1f} {r['d']:>10.1f} "
            f"{over:>8.1f} {over / (r['c'] - r['a']):>12.3f} {over / r['d']:>8.2f}"
        )
    r = results["864"]
    over = r["b"] - r["a"]
    ttfe = results["first_energy"]
    ratio = ttfe["rootstock_s"] / ttfe["bare_s"]

    def verdict(ok: bool) -> str:
        return "yes" if ok else "NO"

    print_table(
        "targets (864 atoms; time to first EMT energy)",
        [
            ("b-a", f"{over:.0f} us", "<= 300 us", verdict(over <= 300)),
            (
                "(b-a)/(c-a)",
                f"{over / (r['c'] - r['a']):.3f}",
                "<= 0.25",
                verdict(over <= 0.25 * (r["c"] - r["a"])),
            ),
            ("(b-a)/d", f"{over / r['d']:.2f}", "<= 5", verdict(over <= 5 * r["d"])),
            ("first energy", f"{ttfe['rootstock_s']:.3f} s vs bare {ttfe['bare_s']:.3f} s", "", ""),
            ("first-energy ratio", f"{ratio:.2f}", "<= 1.3", verdict(ratio <= 1.3)),
        ],
    )
    print(
        textwrap.dedent("""
        (a) null model in-process   (b) RootstockCalculator   (c) ASE SocketIOCalculator
        (d) raw Unix-socket ping-pong of the same byte counts (the practical floor)
    """)
    )


if __name__ == "__main__":
    main()
