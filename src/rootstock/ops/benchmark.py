"""``rootstock benchmark``: what the worker boundary costs for a real model.

For each checkpoint the same seeded random walk runs twice: through
:class:`RootstockCalculator` (a worker behind a Unix socket), and in the env's own
Python calling ``setup()`` directly (:mod:`rootstock.ops.benchmark_probe`, run with
the env's interpreter and the environment a worker gets). The difference of the
per-call medians is the overhead; the energies of the two runs must agree, which
checks that both computed the same thing.

The calculator run goes first, so it is the one that pays for a cold file cache:
its start-up is, if anything, overstated.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rootstock.errors import RootstockError, UsageError, WorkerError, WorkerTimeout
from rootstock.install import Reporter
from rootstock.install.envs import load_installed_env
from rootstock.ops import benchmark_probe
from rootstock.ops.benchmark_probe import WALK_SEED, WALK_STEP, one_call, walk
from rootstock.ops.benchmark_system import BenchmarkSystem, parse_setup_kwargs, parse_system
from rootstock.ops.checkpoints import require_fetched
from rootstock.runtime import FORWARDED_ARRAYS, WorkerOptions, WorkerSpec, resolve_worker_spec

DEFAULT_SYSTEM = "Cu:256"
DEFAULT_CALLS = 100
DEFAULT_WARMUP = 10
DEFAULT_TIMEOUT = 1800.0


# --- results ------------------------------------------------------------------------------


@dataclass
class RunTiming:
    """One run of the walk: per-call seconds, start-up, and what it computed."""

    times_s: list[float]
    startup_s: float
    energies: list[float]
    last_forces: Any
    setup_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """``median_ms``, ``p95_ms``, ``min_ms``, ``startup_s``, ``setup_s``, ``calls``."""
        import numpy as np

        ms = np.asarray(self.times_s, dtype=float) * 1e3
        return {
            "calls": len(self.times_s),
            "median_ms": float(np.median(ms)),
            "p95_ms": float(np.percentile(ms, 95)),
            "min_ms": float(ms.min()),
            "startup_s": self.startup_s,
            "setup_s": self.setup_s,
        }


@dataclass
class CheckpointBenchmark:
    """Both runs of one checkpoint, and how they compare."""

    checkpoint: str
    env: str
    calculator: RunTiming
    in_env: RunTiming

    def to_dict(self) -> dict[str, Any]:
        """One entry of ``results`` in ``--json``."""
        import numpy as np

        calc, ref = self.calculator.to_dict(), self.in_env.to_dict()
        overhead = calc["median_ms"] - ref["median_ms"]
        energy_diff = np.abs(
            np.asarray(self.calculator.energies) - np.asarray(self.in_env.energies)
        )
        force_diff = np.abs(
            np.asarray(self.calculator.last_forces) - np.asarray(self.in_env.last_forces)
        )
        return {
            "checkpoint": self.checkpoint,
            "env": self.env,
            "calculator": calc,
            "in_env": ref,
            "overhead_ms": overhead,
            "overhead_pct": 100.0 * overhead / ref["median_ms"] if ref["median_ms"] else None,
            "first_energy": self.in_env.energies[0],
            "max_energy_diff": float(energy_diff.max()),
            "max_force_diff": float(force_diff.max()) if force_diff.size else 0.0,
        }


@dataclass
class BenchmarkReport:
    """Every checkpoint's benchmark on one system and device."""

    system: BenchmarkSystem
    device: str
    warmup: int
    calls: int
    results: list[CheckpointBenchmark]

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document (shape in docs/benchmark.md)."""
        from rootstock.version import __version__

        return {
            "rootstock": __version__,
            "host": socket.gethostname(),
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
            "device": self.device,
            "system": self.system.to_dict(),
            "walk": {
                "seed": WALK_SEED,
                "step": WALK_STEP,
                "warmup": self.warmup,
                "calls": self.calls,
            },
            "results": [r.to_dict() for r in self.results],
        }


# --- the two runs ------------------------------------------------------------------------


def time_calculator(
    spec: WorkerSpec, system: BenchmarkSystem, warmup: int, calls: int, timeout: float
) -> RunTiming:
    """The walk through RootstockCalculator; start-up counts from before the spawn."""
    from rootstock.install.usage import entry_point
    from rootstock.runtime import RootstockCalculator

    atoms = system.atoms.copy()
    energies, times = [], []
    forces, startup = None, 0.0
    started = time.monotonic()
    # A maintainer's check, not a user's session: recorded like verification.
    with entry_point("benchmark"), RootstockCalculator.from_spec(spec, timeout=timeout) as calc:
        atoms.calc = calc
        for index in walk(atoms, warmup + calls, WALK_SEED):
            tick = time.perf_counter()
            energy, forces = one_call(atoms, system.periodic)
            elapsed = time.perf_counter() - tick
            energies.append(energy)
            if index == 0:
                startup = time.monotonic() - started
            elif index > warmup:
                times.append(elapsed)
    return RunTiming(times, startup, energies, forces)


def probe_request(
    spec: WorkerSpec, system: BenchmarkSystem, warmup: int, calls: int
) -> dict[str, Any]:
    """What the in-env probe is told: the model, the system and the walk."""
    atoms = system.atoms
    return {
        "env_source": str(spec.env_source),
        "checkpoint": spec.checkpoint,
        "device": spec.device,
        "setup_kwargs": spec.setup_kwargs,
        "weights": str(spec.weights) if spec.weights else None,
        "system": {
            "numbers": atoms.numbers.tolist(),
            "positions": atoms.positions.tolist(),
            "cell": atoms.cell.array.tolist(),
            "pbc": atoms.pbc.tolist(),
            "periodic": system.periodic,
            # What the calculator forwards to its worker (a radical's magnetic moments).
            "arrays": {
                name: atoms.arrays[name].tolist()
                for name in FORWARDED_ARRAYS
                if name in atoms.arrays
            },
        },
        "seed": WALK_SEED,
        "warmup": warmup,
        "calls": calls,
    }


def time_in_env(
    spec: WorkerSpec, system: BenchmarkSystem, warmup: int, calls: int, timeout: float
) -> RunTiming:
    """The walk in the env's own Python, with the environment a worker gets."""
    from rootstock.runtime import describe_exit, make_private_dir, spawn_env_script

    run_dir = make_private_dir("rootstock-bench-")
    try:
        request_file, result_file = run_dir / "request.json", run_dir / "result.json"
        request_file.write_text(json.dumps(probe_request(spec, system, warmup, calls)))
        started = time.monotonic()
        # The probe dies with us (the lifeline runner), like a worker.
        process = spawn_env_script(
            spec,
            Path(benchmark_probe.__file__).resolve(),
            [str(request_file), str(result_file)],
            log_path=run_dir / "probe.log",
        )
        try:
            if not process.wait_exit(timeout):
                raise WorkerTimeout(
                    f"the in-env run of {spec.checkpoint} took longer than {timeout:.0f} s",
                    process.output_tail(),
                    hint="raise --timeout, or lower --calls",
                )
        finally:
            code = process.stop(grace=0.0)
        if code != 0 or not result_file.is_file():
            raise WorkerError(
                f"the in-env run of {spec.checkpoint} (env {spec.env_name!r}) "
                f"{describe_exit(code)}",
                process.output_tail(),
                hint="the traceback comes from the env's setup() or the model; "
                "the same call through RootstockCalculator worked",
            )
        result = json.loads(result_file.read_text())
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return RunTiming(
        times_s=list(result["times_s"]),
        startup_s=float(result["first_call_done"]) - started,
        energies=list(result["energies"]),
        last_forces=result["last_forces"],
        setup_s=float(result["setup_s"]),
    )


# --- the operation -----------------------------------------------------------------------


def resolve_benchmarked(checkpoint: str, options: WorkerOptions) -> WorkerSpec:
    """The worker spec for one id: declared (else exit 2) and fetched (else exit 1).

    Without ``options.setup_kwargs`` the env's ``VERIFY_KWARGS`` entry applies, as in
    ``add``. A ``:custom`` id with weights needs no fetch.
    """
    spec = resolve_worker_spec(checkpoint, options)
    env = load_installed_env(spec.layout, spec.env_name)
    if options.setup_kwargs is None and env.verify_kwargs.get(checkpoint):
        spec = dataclasses.replace(spec, setup_kwargs=dict(env.verify_kwargs[checkpoint]))
    if spec.weights is None:
        require_fetched(spec.layout, spec.env_name, checkpoint)
    return spec


def benchmark(
    checkpoints: list[str],
    options: WorkerOptions,
    *,
    system: str = DEFAULT_SYSTEM,
    calls: int = DEFAULT_CALLS,
    warmup: int = DEFAULT_WARMUP,
    timeout: float = DEFAULT_TIMEOUT,
    step: Reporter = lambda _msg: None,
) -> BenchmarkReport:
    """Benchmark every checkpoint with ``options``; every id is checked before anything runs.

    ``timeout`` bounds each step of the calculator run (start-up, any one call) and
    the whole in-env run.
    """
    if not checkpoints:
        raise UsageError("missing CHECKPOINT", hint="`rootstock list` shows the ids")
    if calls < 1:
        raise UsageError("--calls must be at least 1")
    if warmup < 0:
        raise UsageError("--warmup must be 0 or more")
    if not timeout > 0:
        raise UsageError("--timeout must be a positive number of seconds")
    built = parse_system(system)
    specs = [resolve_benchmarked(checkpoint, options) for checkpoint in checkpoints]
    device = options.device
    results = []
    for spec in specs:
        step(f"{spec.checkpoint}: {built.natoms} atoms through RootstockCalculator on {device}")
        calculator = time_calculator(spec, built, warmup, calls, timeout)
        step(f"{spec.checkpoint}: the same walk in the env's own Python (setup() directly)")
        in_env = time_in_env(spec, built, warmup, calls, timeout)
        results.append(CheckpointBenchmark(spec.checkpoint, spec.env_name, calculator, in_env))
    return BenchmarkReport(built, device, warmup, calls, results)


__all__ = [
    "BenchmarkReport",
    "BenchmarkSystem",
    "CheckpointBenchmark",
    "RootstockError",
    "RunTiming",
    "benchmark",
    "parse_setup_kwargs",
    "parse_system",
]
