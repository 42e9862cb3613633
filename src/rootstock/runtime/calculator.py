"""RootstockCalculator: an ASE calculator whose model runs in its own pre-built env.

The checkpoint is resolved (and the arguments validated) when the calculator is
made; the worker starts on the first calculation and stays warm until
:meth:`RootstockCalculator.close` or the end of the ``with`` block.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, ClassVar

import numpy as np
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes

from rootstock.errors import UsageError
from rootstock.runtime.session import WorkerSession
from rootstock.runtime.spec import WorkerSpec, resolve_worker_spec

log = logging.getLogger("rootstock.calculator")

DEFAULT_TIMEOUT = 1800.0


def _json_default(value: Any) -> Any:
    # numpy scalars and arrays are common in atoms.info (ASE readers put them there).
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def info_json(info: dict[str, Any]) -> str:
    """The JSON-serialisable part of ``atoms.info``, as canonical JSON text.

    Values that cannot be serialised (objects, say) are left out: they cannot
    reach the worker, which never unpickles.
    """
    if not info:
        return "{}"
    try:
        return json.dumps(info, sort_keys=True, default=_json_default)
    except (TypeError, ValueError):
        pass
    kept = {}
    for key, value in info.items():
        try:
            json.dumps(value, default=_json_default)
        except (TypeError, ValueError):
            log.debug("atoms.info[%r] is not JSON-serialisable; not forwarded", key)
            continue
        kept[str(key)] = value
    return json.dumps(kept, sort_keys=True, default=_json_default)


def is_3d_periodic(atoms: Any) -> bool:
    """True for a cell that is periodic in all three directions with three vectors."""
    # Written out because Cell.rank costs more than the rest of a call's bookkeeping.
    a, b, c = atoms.cell.array
    return bool(atoms.pbc.all() and a.any() and b.any() and c.any())


class RootstockCalculator(Calculator):
    """Run an installed checkpoint through a worker in its env.

    Parameters
    ----------
    checkpoint:
        A checkpoint id declared by an installed env (``rootstock list``).
    root, cluster, cache_root:
        Where the install is. ``cluster`` names this machine: it picks
        ``CLUSTERS`` variants and supplies the root only when ``root``,
        ``$ROOTSTOCK_ROOT`` and config.toml give none.
    device:
        Passed to the env's ``setup()`` (``cuda``, ``cpu``, ``xpu``, ...).
    setup_kwargs:
        Extra JSON-serialisable keywords for ``setup()``; they may not set
        ``checkpoint``, ``device`` or ``path``.
    timeout:
        Seconds to wait for the worker at each step: start-up (including loading
        the model) or one calculation. ``None`` waits as long as the worker lives.
    weights:
        Your own weights file, only with a ``<family>:custom`` checkpoint id.
    """

    implemented_properties: ClassVar[list[str]] = ["energy", "free_energy", "forces", "stress"]
    name = "rootstock"

    def __init__(
        self,
        checkpoint: str,
        root: str | os.PathLike | None = None,
        cluster: str | None = None,
        cache_root: str | os.PathLike | None = None,
        device: str = "cuda",
        setup_kwargs: dict[str, Any] | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        weights: str | os.PathLike | None = None,
    ) -> None:
        spec = resolve_worker_spec(
            checkpoint,
            root=root,
            cluster=cluster,
            cache_root=cache_root,
            device=device,
            setup_kwargs=setup_kwargs,
            weights=weights,
        )
        self._bind(spec, timeout)

    @classmethod
    def from_spec(cls, spec: WorkerSpec, timeout: float | None = DEFAULT_TIMEOUT):
        """A calculator for an already resolved :class:`WorkerSpec`.

        Verification uses this: ``add`` and ``smoke-test`` have already chosen the
        env (a cluster variant, say), so nothing is resolved a second time.
        """
        calc = cls.__new__(cls)
        calc._bind(spec, timeout)
        return calc

    def _bind(self, spec: WorkerSpec, timeout: float | None) -> None:
        Calculator.__init__(self)
        if timeout is not None and not timeout > 0:
            raise UsageError("timeout must be a positive number of seconds, or None")
        self.spec: WorkerSpec = spec
        self.timeout = timeout
        self.parameters.update(
            checkpoint=spec.checkpoint,
            env=spec.env_name,
            device=spec.device,
            setup_kwargs=spec.setup_kwargs,
            weights=str(spec.weights) if spec.weights else None,
        )
        self._session: WorkerSession | None = None
        self._info_json = "{}"
        # Once stress was asked for, keep computing it (3-D periodic cells only), so a
        # cell filter's get_forces() + get_stress() pair costs one round trip.
        self._stress_requested = False

    # --- worker lifecycle -------------------------------------------------------------

    @property
    def checkpoint(self) -> str:
        return self.spec.checkpoint

    @property
    def worker_pid(self) -> int | None:
        """The running worker's process id, or None when none is running."""
        session = self._session
        return session.pid if session is not None and session.alive else None

    def _worker(self) -> WorkerSession:
        session = self._session
        if session is not None and not session.owned:
            session.close()  # forked: leave the parent's worker alone, start our own
            session = None
        if session is None or not session.alive:
            session = self._session = WorkerSession(self.spec, timeout=self.timeout).start()
        return session

    def close(self) -> None:
        """Stop the worker; the next calculation would start a fresh one."""
        if self._session is not None:
            self._session.close()
            self._session = None

    def __enter__(self) -> RootstockCalculator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- ASE interface ----------------------------------------------------------------

    def check_state(self, atoms: Any, tol: float = 1e-15) -> list[str]:
        """ASE's checks plus ``info``: a change of atoms.info alone recalculates."""
        changes = list(super().check_state(atoms, tol))
        if not changes and self.atoms is not None and info_json(atoms.info) != self._info_json:
            changes.append("info")
        return changes

    def calculate(
        self,
        atoms: Any = None,
        properties: list[str] | tuple[str, ...] = ("energy",),
        system_changes: list[str] = all_changes,
    ) -> None:
        """Send the structure to the worker and store energy, forces (and stress)."""
        super().calculate(atoms, properties, system_changes)
        atoms = self.atoms
        periodic = is_3d_periodic(atoms)
        if "stress" in properties:
            if not periodic:
                raise PropertyNotImplementedError(
                    "stress is only computed for cells periodic in all three directions"
                )
            self._stress_requested = True
        want_stress = periodic and self._stress_requested
        text = info_json(atoms.info)
        reply = self._worker().compute(atoms, text, want_stress)
        self._info_json = text
        energy = float(reply.energy)
        results: dict[str, Any] = {
            "energy": energy,
            "free_energy": energy,
            "forces": reply.forces,
        }
        if reply.extra:
            extra = reply.extra_json()
            if "free_energy" in extra:
                results["free_energy"] = float(extra["free_energy"])
        if want_stress:
            sigma = -reply.virial / atoms.cell.volume
            results["stress"] = np.array(
                [
                    sigma[0, 0],
                    sigma[1, 1],
                    sigma[2, 2],
                    (sigma[1, 2] + sigma[2, 1]) / 2,
                    (sigma[0, 2] + sigma[2, 0]) / 2,
                    (sigma[0, 1] + sigma[1, 0]) / 2,
                ]
            )
        self.results = results
