"""What ``benchmarks/coalescing.py`` stands on: its cases, the root of real uv-built envs
(``benchmarks/_throughput_setup.py``'s, with tests/envs/null_batch.py added), the
structures, and the model's own calls on them."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _throughput_setup import ENV_FILES, REPO, InEnvModel, build_root, default_build_dir

CHGNET, NULL, NULL_BATCH = "chgnet-0.3.0", "null", "null-batch"
# _throughput_setup builds the envs this table names (env name: file); null-batch is
# this benchmark's own.
ENV_FILES.setdefault(NULL_BATCH, REPO / "tests" / "envs" / "null_batch.py")


@dataclass(frozen=True)
class Case:
    """One model on one cell size."""

    label: str
    checkpoint: str
    env: str
    repeat: int  # fcc Cu primitive cells per side: 2 gives 8 atoms, 4 gives 64

    @property
    def natoms(self) -> int:
        return self.repeat**3


CASES = [
    Case("chgnet Cu8", CHGNET, "chgnet", 2),
    Case("chgnet Cu64", CHGNET, "chgnet", 4),
    Case("null Cu8", NULL, NULL, 2),
    Case("null-batch Cu8", NULL_BATCH, NULL_BATCH, 2),
]


# --- the root --------------------------------------------------------------------------------


def prepare_root(args: argparse.Namespace, quick: bool, work: Path) -> tuple[Path, set, list]:
    """(the root, the env names there to measure, notes for the report)."""
    wanted = [NULL, NULL_BATCH] + ([] if args.no_chgnet else ["chgnet"])
    if args.root:
        root = Path(args.root)
        present = {name for name in wanted if (root / "envs" / name).is_dir()}
        return root, present, [f"no {name} env in {root}" for name in wanted if name not in present]
    root = Path(args.build_dir) if args.build_dir else default_build_dir()
    build_root(root, [NULL, NULL_BATCH], work, {})
    if args.no_chgnet:
        return root, {NULL, NULL_BATCH}, ["CHGNet skipped (--no-chgnet)"]
    timeout = args.build_timeout or (300.0 if quick else 2400.0)
    try:
        build_root(root, ["chgnet"], work, {"chgnet": timeout})
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        if not quick:
            raise
        first = str(exc).strip().splitlines()[0]
        note = f"CHGNet not built within {timeout:.0f} s ({first}): null models only"
        return root, {NULL, NULL_BATCH}, [note]
    return root, {NULL, NULL_BATCH, "chgnet"}, []


# --- structures ----------------------------------------------------------------------------


def save_cells(count: int, repeat: int, path: Path) -> Path:
    """``count`` fcc Cu cells (``repeat``^3 atoms), each rattled 0.05 Å by its seed, as
    arrays: the clients take their own slices, and the in-env run all of them."""
    import numpy as np
    from ase.build import bulk

    base = bulk("Cu", "fcc", a=3.6) * (repeat, repeat, repeat)
    images = []
    for seed in range(count):
        atoms = base.copy()
        atoms.rattle(0.05, seed=seed)
        images.append(atoms)
    np.savez(
        path,
        numbers=np.array([a.numbers for a in images]),
        positions=np.array([a.positions for a in images]),
        cells=np.array([a.cell.array for a in images]),
    )
    return path


def load_cells(path: Path) -> list[Any]:
    import numpy as np
    from ase import Atoms

    data = np.load(path)
    return [
        Atoms(numbers=n, positions=p, cell=c, pbc=True)
        for n, p, c in zip(data["numbers"], data["positions"], data["cells"], strict=True)
    ]


# --- the model's own calls -------------------------------------------------------------------


def own_calls(
    root: Path, case: Case, device: str, cells: Path, batch_size: int, repeats: int
) -> dict[str, Any]:
    """Structures/s of the model's own batched call (best of ``repeats``) and of its own
    loop, and the energies (of the batched call where there is one, else of the loop)."""
    from rootstock.runtime import WorkerOptions, resolve_worker_spec

    spec = resolve_worker_spec(case.checkpoint, WorkerOptions(root, device=device))
    count = len(load_cells(cells))
    batch_s: float | None = None
    loop_s = float("inf")
    if case.env == "chgnet":
        with InEnvModel(spec, cells) as own:
            name = own.batched
            for _ in range(repeats):
                seconds, energies = own.batch(batch_size)
                batch_s = seconds if batch_s is None else min(batch_s, seconds)
            loop_s = own.loop()[0]  # once: a reference, not a target
        where = "in its env"
    else:
        name, energies, batch_s, loop_s = _in_process(spec.env_source, cells, batch_size, repeats)
        where = "in-process"
    return {
        "batched_call": name,
        "where": where,
        "batch_size": batch_size,
        "batched_per_s": count / batch_s if batch_s else None,
        "loop_per_s": count / loop_s,
        "energies": energies,
    }


def _in_process(
    source: Path, cells: Path, batch_size: int, repeats: int
) -> tuple[str | None, list[float], float | None, float]:
    """The null models in this process (numpy and ASE are all they need): their loop,
    and the ``evaluate_batch`` hook in batches where the env has one."""
    loader = importlib.util.spec_from_file_location("bench_coalescing_env", source)
    module = importlib.util.module_from_spec(loader)  # type: ignore[arg-type]
    loader.loader.exec_module(module)  # type: ignore[union-attr]
    calc = module.setup(source.stem, device="cpu")
    images = load_cells(cells)
    hook = getattr(module, "evaluate_batch", None)
    loop_s, batch_s = float("inf"), None
    energies: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        energies = []
        for atoms in images:
            atoms.calc = calc
            energies.append(atoms.get_potential_energy())
            atoms.get_forces()
        loop_s = min(loop_s, time.perf_counter() - start)
        for atoms in images:
            atoms.calc = None
        if hook is not None:
            start = time.perf_counter()
            for first in range(0, len(images), batch_size):
                hook(calc, images[first : first + batch_size], ("energy", "forces"))
            seconds = time.perf_counter() - start
            batch_s = seconds if batch_s is None else min(batch_s, seconds)
    return ("evaluate_batch" if hook else None), energies, batch_s, loop_s
