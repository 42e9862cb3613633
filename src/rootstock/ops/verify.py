"""Verification: a forward pass of a checkpoint on a small reference structure.

The pass runs in a real worker, offline (``HF_HUB_OFFLINE=1``), on the requested
device. It checks that energy, forces and stress are finite and correctly shaped,
then, in the same worker session, that forces and stress agree with the energy
(:mod:`rootstock.ops.consistency`: about ten more energy calls), so a unit or sign
error fails the first ``add``. A pass returns a *fingerprint* (energy per atom,
force norm, stress) that later re-verifications are compared with, so a rebuild
that silently changes the physics shows up as *drifted*.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rootstock.errors import DeviceNotVisible, RootstockError, WorkerDiedError, WorkerError
from rootstock.install.envfile import EnvFile
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    Fingerprint,
    Verification,
    device_kind,
    record_verification,
)
from rootstock.install.usage import entry_point
from rootstock.names import is_device_name
from rootstock.ops.checkpoints import build_snapshot
from rootstock.ops.integrity import drop_rewritten_weights, recheck_weights, weight_stats

if TYPE_CHECKING:
    import numpy as np
    from ase import Atoms

    from rootstock.runtime import RootstockCalculator

DEFAULT_VERIFY_TIMEOUT = 600.0
# Python's own words when a call to setup() lacks one of its parameters: the only
# failure that a VERIFY_KWARGS entry can fix.
_MISSING_SETUP_ARGUMENT = re.compile(
    r"failed in setup\(\): TypeError: setup\(\) missing \d+ required "
    r"(?:positional |keyword-only |keyword )?arguments?: "
)


def default_reference() -> dict[str, Any]:
    """The built-in reference: 8 Cu atoms in a compressed, sheared, rattled fcc cell.

    Compression keeps the energy far from zero (so a 0.1% change is visible), the
    shear gives a non-trivial stress, and the rattle gives non-zero forces. Metals
    and general materials models all handle it.
    """
    a = 3.45
    base = [(0, 0, 0), (0, 0.5, 0.5), (0.5, 0, 0.5), (0.5, 0.5, 0)]
    rattle = [
        (0.03, -0.02, 0.01),
        (-0.01, 0.04, -0.03),
        (0.02, 0.01, -0.04),
        (-0.03, -0.01, 0.02),
        (0.01, -0.03, -0.02),
        (0.04, 0.02, 0.01),
        (-0.02, 0.03, 0.03),
        (0.0, -0.04, 0.02),
    ]
    cells = [(i, x, y, z) for i in (0, 1) for x, y, z in base]  # two cubic cells along x
    positions = [
        ((i + x) * a + dx, y * a + dy, z * a + dz)
        for (i, x, y, z), (dx, dy, dz) in zip(cells, rattle, strict=True)
    ]
    return {
        "symbols": ["Cu"] * 8,
        "positions": positions,
        "cell": [[2 * a, 0.0, 0.0], [0.05, a, 0.0], [0.0, 0.03, a]],
        "pbc": [True, True, True],
    }


def reference_atoms(env: EnvFile) -> Atoms:
    """The env's ``VERIFY_STRUCTURE`` as ASE Atoms, or the built-in reference."""
    from ase import Atoms

    spec = env.verify_structure or default_reference()
    return Atoms(
        symbols=spec["symbols"],
        positions=spec["positions"],
        cell=spec.get("cell"),
        pbc=spec.get("pbc", spec.get("cell") is not None),
    )


@dataclass
class VerifyOutcome:
    """What one verification found (before it is recorded)."""

    checkpoint: str
    env: str
    device: str
    passed: bool
    seconds: float
    fingerprint: Fingerprint | None = None
    message: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    # The physics checks (ConsistencyReport.to_dict() plus "seconds"); None when the
    # forward pass itself failed, so nothing could be checked.
    checks: dict[str, Any] | None = None
    # How the worker started: "mount" or "copy" (a node-local stage), None (shared env).
    staged: str | None = None

    def record(self, build: dict[str, Any]) -> dict[str, Any]:
        """The ``result`` dict that :func:`manifest.record_verification` takes."""
        result: dict[str, Any] = {
            "passed": self.passed,
            "device": self.device,
            "build": build,
            # The reference a pass is compared with is the one for these kwargs.
            "kwargs": self.kwargs,
            "staged": self.staged,
        }
        if self.fingerprint is not None:
            result["fingerprint"] = self.fingerprint
        if self.message:
            result["message"] = self.message
        if self.checks is not None:
            result["checks"] = self.checks
        return result


def run_verification(
    layout: InstallLayout,
    env: EnvFile,
    checkpoint: str,
    *,
    device: str,
    kwargs: dict[str, Any] | None,
    timeout: float = DEFAULT_VERIFY_TIMEOUT,
    versions: dict[str, Any] | None = None,
) -> VerifyOutcome:
    """Spawn a worker for ``checkpoint``, check a forward pass and its physics.

    ``kwargs`` None means: use the env's ``VERIFY_KWARGS`` entry (explicit kwargs
    always win). Model errors become a failed outcome, never an exception; a device
    this node does not show raises :class:`~rootstock.errors.DeviceNotVisible`
    before ``setup()`` runs, and nothing is recorded. The outcome's ``device`` is the
    one the worker says the model ran on (EMT: ``cpu``), else the one asked for. A
    forward pass that is finite and well shaped is then checked for consistency
    (forces and stress against the energy, judged as the env's ``VERIFY_CHECKS``
    entry says) in the same worker; a failed check fails the outcome, and its
    fingerprint is kept on the outcome but never becomes a reference.
    """
    import numpy as np

    from rootstock.runtime import RootstockCalculator, WorkerSpec

    used = dict(env.verify_kwargs.get(checkpoint, {})) if kwargs is None else dict(kwargs)
    atoms = reference_atoms(env)
    start = time.monotonic()
    outcome = VerifyOutcome(checkpoint, env.name, device, False, 0.0, kwargs=used)
    spec = WorkerSpec(
        layout=layout,
        checkpoint=checkpoint,
        env_name=env.name,
        device=device,
        setup_kwargs=used,
        check_device=True,
    )
    problems: list[str] = []
    try:
        with entry_point("verify"), RootstockCalculator.from_spec(spec, timeout=timeout) as calc:
            atoms.calc = calc
            energy = float(atoms.get_potential_energy())
            outcome.staged = calc.staged
            outcome.device = device_ran_on(calc.model_device, device)
            forces = np.asarray(atoms.get_forces(), dtype=float)
            periodic = bool(atoms.pbc.all())
            stress = np.asarray(atoms.get_stress(), dtype=float) if periodic else None
            problems = _check_result(energy, forces, stress, len(atoms))
            if not problems:
                outcome.checks, problem = _check_physics(
                    atoms, calc, env, checkpoint, outcome.device
                )
                if problem:
                    problems.append(problem)
    except DeviceNotVisible:
        raise
    except RootstockError as exc:
        outcome.seconds = time.monotonic() - start
        outcome.message = _failure_message(exc, env, checkpoint, kwargs)
        return outcome
    outcome.seconds = time.monotonic() - start
    if problems and outcome.checks is None:
        outcome.message = "; ".join(problems)
        return outcome
    versions = versions or {}
    outcome.fingerprint = {
        "energy_per_atom": energy / len(atoms),
        "force_norm": float(np.linalg.norm(forces)),
        "stress": [float(s) for s in stress] if stress is not None else None,
        "natoms": len(atoms),
        "device_kind": device_kind(outcome.device),
        "torch": versions.get("torch"),
        "env_versions": {k: v for k, v in versions.items() if v},
    }
    outcome.passed = not problems
    outcome.message = "; ".join(problems) or None
    return outcome


def device_ran_on(reported: str | None, requested: str) -> str:
    """The device to record: the one the worker reported, if the manifest can hold it
    (``mps:0`` is kept as ``mps``), else the one asked for (an older worker reports
    none, and a torch model with no module in reach is not guessed at)."""
    if reported and is_device_name(reported):
        return reported
    base = (reported or "").partition(":")[0]
    if base and is_device_name(base):
        return base
    return requested


DeviceLease = Callable[[], AbstractContextManager[str]]
"""Lends a device for one verification and takes it back (``smoke-test --jobs``'s slots)."""


@dataclass
class RecordedVerification:
    """One verification and the manifest record it became."""

    outcome: VerifyOutcome
    record: Verification


def verify_and_record(
    layout: InstallLayout,
    env: EnvFile,
    checkpoint: str,
    cluster: str,
    *,
    device: str | DeviceLease,
    kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_VERIFY_TIMEOUT,
    accept_drift: bool = False,
    recheck: bool = False,
    rehash: bool = False,
) -> RecordedVerification:
    """Verify ``checkpoint`` (:func:`run_verification`) and record it for ``cluster``.

    The build recorded is the one the worker runs, captured before it starts, and the
    manifest then judges the outcome: ``verified``, ``failed`` or ``drifted`` against
    the reference fingerprint for these kwargs (``accept_drift`` makes this pass the
    reference). ``add`` and ``smoke-test`` both verify through here.

    ``device`` is a device string, or a :data:`DeviceLease` that lends one: the
    device is held while the worker runs and given back before the manifest write,
    so a ``--jobs`` pool never keeps a GPU idle waiting on the manifest lock.

    ``recheck`` (``smoke-test``, ``sync``) first compares the weight files with what
    ``add`` recorded (:func:`rootstock.ops.integrity.recheck_weights`; ``rehash``
    hashes every one): a changed file records ``tampered`` and no worker starts. A
    recorded file that the worker itself rewrote leaves ``weights``
    (:func:`rootstock.ops.integrity.drop_rewritten_weights`).
    """
    if recheck:
        tampered = _record_if_tampered(
            layout, env, checkpoint, cluster, device=device, kwargs=kwargs, rehash=rehash
        )
        if tampered is not None:
            return tampered
    before = weight_stats(layout, env.name, checkpoint)
    lease = nullcontext(device) if isinstance(device, str) else device()
    with lease as slot:
        build, versions = build_snapshot(layout, env)
        outcome = run_verification(
            layout,
            env,
            checkpoint,
            device=slot,
            kwargs=kwargs,
            timeout=timeout,
            versions=versions,
        )
    drop_rewritten_weights(layout, env.name, checkpoint, before)
    record = record_verification(
        layout, env.name, checkpoint, cluster, outcome.record(build), accept_drift=accept_drift
    )
    return RecordedVerification(outcome, record)


def _record_if_tampered(
    layout: InstallLayout,
    env: EnvFile,
    checkpoint: str,
    cluster: str,
    *,
    device: str | DeviceLease,
    kwargs: dict[str, Any] | None,
    rehash: bool,
) -> RecordedVerification | None:
    """Re-check the weight files; on a change, record ``tampered`` and return it."""
    recheck = recheck_weights(layout, env.name, checkpoint, rehash=rehash)
    if recheck.problem is None:
        return None
    if isinstance(device, str):
        slot = device
    else:
        with device() as lent:  # only its name: the device kind the record is filed under
            slot = lent
    used = dict(env.verify_kwargs.get(checkpoint, {})) if kwargs is None else dict(kwargs)
    build, _versions = build_snapshot(layout, env)
    outcome = VerifyOutcome(checkpoint, env.name, slot, False, 0.0, None, recheck.problem, used)
    result = {**outcome.record(build), "tampered": True}
    record = record_verification(layout, env.name, checkpoint, cluster, result)
    return RecordedVerification(outcome, record)


def _check_physics(
    atoms: Atoms, calc: RootstockCalculator, env: EnvFile, checkpoint: str, device: str
) -> tuple[dict[str, Any] | None, str | None]:
    """Run the consistency check on the live calculator: ``(checks, problem)``.

    ``checks`` is None when the check could not run (the worker failed on a
    displaced structure); ``problem`` is the one-line failure, or None.
    """
    from rootstock.ops.consistency import GRADIENT, check_consistency

    modes = env.verify_checks.get(checkpoint, {})
    started = time.monotonic()
    try:
        report = check_consistency(
            atoms,
            calc,
            dtype=getattr(calc, "model_dtype", None),
            device=device,
            modes=modes,
        )
    except RootstockError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = lines[0] if lines else type(exc).__name__
        return None, f"the physics check (forces and stress against the energy) failed: {reason}"
    checks = report.to_dict()
    checks["seconds"] = round(time.monotonic() - started, 3)
    if report.ok:
        return checks, None
    message = report.message or "forces or stress disagree with the energy"
    plain = [
        name
        for name, check in report.checks.items()
        if not check.ok and check.mode == GRADIENT and check.ratio and check.ratio > 0
        and check.message and ": a unit error" not in check.message
    ]  # fmt: skip
    if plain:
        message += (
            f" (if {checkpoint} predicts {' and '.join(plain)} directly, declare it in "
            f"VERIFY_CHECKS in environments/{env.name}.py)"
        )
    return checks, message


def _check_result(
    energy: float, forces: np.ndarray, stress: np.ndarray | None, natoms: int
) -> list[str]:
    import numpy as np

    problems: list[str] = []
    if not np.isfinite(energy):
        problems.append(f"energy is not finite ({energy})")
    if forces.shape != (natoms, 3):
        problems.append(f"forces have shape {forces.shape}, expected ({natoms}, 3)")
    elif not np.isfinite(forces).all():
        problems.append("forces contain non-finite values")
    if stress is not None:
        if stress.shape != (6,):
            problems.append(f"stress has shape {stress.shape}, expected (6,)")
        elif not np.isfinite(stress).all():
            problems.append("stress contains non-finite values")
    return problems


def _failure_message(
    exc: RootstockError, env: EnvFile, checkpoint: str, kwargs: dict[str, Any] | None
) -> str:
    if isinstance(exc, WorkerError) and not isinstance(exc, WorkerDiedError):
        # The session's message already ends in the model's "Type: text"; the
        # traceback's last line would repeat it (module-qualified, so unmatched).
        message = exc.message.strip().splitlines()[0] if exc.message.strip() else type(exc).__name__
    else:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        # A dead worker's output tail ends with what killed it (e.g. "MemoryError").
        last = next(
            (line.strip() for line in reversed(lines) if "Error" in line or "Exception" in line),
            lines[0] if lines else str(exc),
        )
        message = f"{lines[0]}" if lines else type(exc).__name__
        if last and last not in message:
            message += f": {last}"
    if (
        kwargs is None
        and checkpoint not in env.verify_kwargs
        and _MISSING_SETUP_ARGUMENT.search(message)
    ):
        message += (
            f" ({checkpoint} needs a keyword argument that nothing gave setup(): declare "
            f"it in VERIFY_KWARGS in environments/{env.name}.py)"
        )
    return message
