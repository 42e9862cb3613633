"""RootstockCalculator: an ASE calculator whose model runs in its own pre-built env.

The checkpoint is resolved (and the arguments validated) when the calculator is
made; the worker starts on the first calculation and stays warm until the last
calculator sharing it (:mod:`rootstock.runtime.shared`) is closed or collected.

What a model computes beyond energy, forces and stress (``magmoms``, ``charges``,
``energies``, ``dipole``) and the dtype it runs in are learned from the worker's
first reply, so ``implemented_properties`` is per instance.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes

from rootstock.errors import ProtocolError, UsageError, WorkerError
from rootstock.runtime import shared
from rootstock.runtime.batch import BatchSize, checked_batch_size, planned_memory
from rootstock.runtime.provenance import Provenance, build_provenance
from rootstock.runtime.session import WorkerSession
from rootstock.runtime.spec import WorkerOptions, WorkerSpec, resolve_worker_spec
from rootstock.runtime.structure import info_json, is_3d_periodic, stress_from_virial
from rootstock.runtime.worker_keys import worker_key
from rootstock.wire.framing import EXTRA_PROPERTIES, ForceReply, extra_array

DEFAULT_TIMEOUT = 1800.0
#: Chunks sized by memory in the worker (runtime/batch.py, worker/memory.py).
DEFAULT_BATCH_SIZE: BatchSize = "auto"
DEFAULT_MAX_ATOMS_PER_CHUNK = 20_000
# What every instance computes; the model's extras are added once the worker says.
BASE_PROPERTIES = ("energy", "free_energy", "forces", "stress")
_BASE_SET = frozenset(BASE_PROPERTIES)


class RootstockCalculator(Calculator):
    """Run an installed checkpoint through a worker in its env.

    Parameters
    ----------
    checkpoint:
        A checkpoint id declared by an installed env (``rootstock list``).
    root, cluster, cache_root:
        Where the install is. ``root`` wins. Otherwise ``cluster``, which names
        this machine and picks ``CLUSTERS`` variants, supplies its registry root,
        before ``$ROOTSTOCK_ROOT`` and then config.toml. A ``cluster`` that neither
        the registry nor the install's manifest names is a ``UsageError`` listing
        the known ones. ``cache_root`` overrides the one ``layout.json`` declares.
    device:
        Passed to the env's ``setup()`` (``cuda``, ``cpu``, ``xpu``, ...).
    setup_kwargs:
        Extra JSON-serialisable keywords for ``setup()``; they may not set
        ``checkpoint``, ``device`` or ``path``.
    timeout:
        Seconds to wait for the worker at each step: start-up (including loading
        the model) or one calculation. ``None`` waits as long as the worker lives.
        Per call: a shared worker serves each calculator with its own.
    weights:
        Your own weights file or directory, only with a ``<family>:custom`` id.
    allow_nonfinite:
        Accept NaN or inf in the model's energy, forces and stress. By default
        they raise :class:`~rootstock.errors.WorkerError` (the worker stays up), as
        does a result of the wrong type or shape, which is never accepted.
    batch_size, max_atoms_per_chunk:
        How :meth:`calculate_batch` cuts its input into chunks (one round trip
        each): at most ``batch_size`` structures and ``max_atoms_per_chunk`` atoms;
        a larger structure goes alone. ``"auto"`` (the default) sends generous
        chunks and lets the worker run its model in sub-batches that fit
        ``max_memory``; an integer is a fixed count, each chunk one model call.
    max_memory:
        With ``batch_size="auto"``, the memory one model call may add: a fraction
        of the device's total memory (``0.25``), bytes, or a string (``"4GB"``,
        ``"512MiB"``, ``"25%"``). ``None``: half the free GPU memory, or a quarter
        of the available RAM (docs/calculator.md, "Chunks that fit in memory").
    shared:
        Share one worker with the other calculators of this process that have the
        same worker key (:mod:`rootstock.runtime.worker_keys`); ``False`` gives this
        calculator a worker of its own.
    pool:
        Attach to the user's pooled worker for this key (``rootstock workers``),
        starting one that outlives this process until its idle timeout. ``None``
        reads ``$ROOTSTOCK_POOL`` (``1`` turns it on).
    stage:
        How the worker starts on this node (docs/cold-start.md): ``"auto"`` (a
        node-local stage of the build's image: a squashfuse mount where FUSE works,
        else an extracted copy), ``"mount"``, ``"copy"``, or ``"off"`` (the shared
        env). ``None`` reads ``$ROOTSTOCK_STAGE``, then ``stage`` in config.toml,
        then takes ``"auto"``.

    Attributes
    ----------
    implemented_properties:
        Energy, free energy, forces and stress, plus the extras this model fills
        (``magmoms``, ``charges``, ``energies``, ``dipole``) once a calculation has
        run; asking for an extra first starts the worker to find out.
    model_dtype:
        The dtype the model computes in (``"float32"``, ``"float64"``, ...), or
        None before the first calculation.
    model_device:
        The device the model's parameters are on (``"cpu"``, ``"cuda:0"``, ...;
        ``"cpu"`` for a model without torch), or None before the first
        calculation and when the worker cannot tell (or predates the report).
    provenance:
        What produced the results (:class:`~rootstock.runtime.provenance.Provenance`):
        checkpoint, env build id, lockfile sha256, package versions, weight hashes,
        rootstock version, cluster and ``model_device``. Read from the install's files
        on first access, once; after the first calculation it is also in
        ``parameters["provenance"]``, which quacc and ASE serialise.
    """

    # A tuple, which ASE only iterates and searches: no caller can change the base
    # every instance starts from in place.
    implemented_properties: tuple[str, ...] = BASE_PROPERTIES  # type: ignore[assignment]  # ASE annotates list[str]
    name = "rootstock"

    def __init__(
        self,
        checkpoint: str,
        root: str | os.PathLike[str] | None = None,
        cluster: str | None = None,
        cache_root: str | os.PathLike[str] | None = None,
        device: str = "cuda",
        setup_kwargs: dict[str, Any] | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        weights: str | os.PathLike[str] | None = None,
        allow_nonfinite: bool = False,
        batch_size: BatchSize = DEFAULT_BATCH_SIZE,
        max_atoms_per_chunk: int = DEFAULT_MAX_ATOMS_PER_CHUNK,
        shared: bool = True,
        pool: bool | None = None,
        stage: str | None = None,
        max_memory: float | int | str | None = None,
    ) -> None:
        options = WorkerOptions(
            root,
            cluster,
            cache_root,
            device=device,
            setup_kwargs=setup_kwargs,
            weights=weights,
            stage=stage,
        )
        self._bind(resolve_worker_spec(checkpoint, options), timeout, allow_nonfinite)
        self._bind_sharing(batch_size, max_atoms_per_chunk, shared, pool, max_memory)

    @classmethod
    def from_spec(
        cls,
        spec: WorkerSpec,
        timeout: float | None = DEFAULT_TIMEOUT,
        allow_nonfinite: bool = False,
    ) -> RootstockCalculator:
        """A calculator for an already resolved :class:`WorkerSpec`.

        Verification uses this: ``add`` and ``smoke-test`` have already chosen the
        env (a cluster variant, say), so nothing is resolved a second time.
        """
        calc = cls.__new__(cls)
        calc._bind(spec, timeout, allow_nonfinite)
        # Verification wants a worker of its own: never a warm one another caller shares.
        calc._bind_sharing(DEFAULT_BATCH_SIZE, DEFAULT_MAX_ATOMS_PER_CHUNK, False, False)
        return calc

    def _bind(self, spec: WorkerSpec, timeout: float | None, allow_nonfinite: bool) -> None:
        Calculator.__init__(self)
        if timeout is not None and not timeout > 0:
            raise UsageError("timeout must be a positive number of seconds, or None")
        if not isinstance(allow_nonfinite, bool):
            raise UsageError(f"allow_nonfinite must be True or False, not {allow_nonfinite!r}")
        self.spec: WorkerSpec = spec
        self.timeout = timeout
        self.allow_nonfinite = allow_nonfinite
        self.parameters.update(
            checkpoint=spec.checkpoint,
            env=spec.env_name,
            device=spec.device,
            setup_kwargs=spec.setup_kwargs,
            weights=str(spec.weights) if spec.weights else None,
        )
        self._hold = shared.Holder()
        self._call_lock = threading.RLock()
        self._info_json = "{}"
        # Once stress was asked for, keep computing it (3-D periodic cells only), so a
        # cell filter's get_forces() + get_stress() pair costs one round trip.
        self._stress_requested = False
        # Extras are sticky the same way; their values travel only once asked for.
        self._extras_requested: tuple[str, ...] = ()
        self._model_extras: tuple[str, ...] | None = None  # None: no reply yet
        self.implemented_properties = BASE_PROPERTIES
        self.model_dtype: str | None = None
        self.model_device: str | None = None
        self._provenance: Provenance | None = None  # read on first access
        #: The worker's memory report of the last chunk sent with a memory bound
        #: (docs/protocol.md, "Batch frames"); None before, or from a worker that
        #: does not size by memory.
        self.memory_report: dict[str, Any] | None = None

    def _bind_sharing(
        self,
        batch_size: BatchSize,
        max_atoms_per_chunk: int,
        shared: bool,
        pool: bool | None,
        max_memory: float | int | str | None = None,
    ) -> None:
        batch_size = checked_batch_size(batch_size)
        planned_memory(batch_size, max_memory, None)  # checked now, used per batch
        value = max_atoms_per_chunk
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UsageError(f"max_atoms_per_chunk must be a positive integer, not {value!r}")
        if not isinstance(shared, bool):
            raise UsageError(f"shared must be True or False, not {shared!r}")
        if pool is not None and not isinstance(pool, bool):
            raise UsageError(f"pool must be True, False or None, not {pool!r}")
        self.batch_size = batch_size
        self.max_atoms_per_chunk = max_atoms_per_chunk
        self.max_memory = max_memory
        self.shared = shared
        self.pool = os.environ.get("ROOTSTOCK_POOL", "") == "1" if pool is None else pool

    # --- worker lifecycle -------------------------------------------------------------

    @property
    def checkpoint(self) -> str:
        return self.spec.checkpoint

    @property
    def worker_pid(self) -> int | None:
        """The running worker's process id (shared or not), or None when none is running."""
        session = self._session
        return session.pid if session is not None and session.alive else None

    @property
    def staged(self) -> str | None:
        """How the running worker was started: ``"mount"`` or ``"copy"`` (from a
        node-local stage), or None (from the shared env, pooled, or none running)."""
        session = self._session
        if session is None or not session.alive or session.process is None:
            return None
        return session.process.staged

    @property
    def provenance(self) -> Provenance:
        """What produced this calculator's results; ``device`` is None until the worker
        has reported its model (the first calculation)."""
        if self._provenance is None:
            self._provenance = build_provenance(self.spec)
        return {**self._provenance, "device": self.model_device}

    @property
    def _session(self) -> WorkerSession | None:
        """The session this calculator holds now (shared with its sharers), if any."""
        return self._hold.session

    def _registry_key(self) -> Hashable | None:
        """What a sharer must match: the worker key, whether pooled, and allow_nonfinite.

        allow_nonfinite travels in the session's INIT, so calculators that differ in it
        cannot send through one session.
        """
        if not self.shared:
            return None
        return (worker_key(self.spec), self.pool, self.allow_nonfinite)

    def _start_session(self) -> WorkerSession:
        if self.pool:
            # Lazy: only pooled calculators need the pool client.
            from rootstock.runtime.pool.client import attach

            return attach(
                self.spec,
                worker_key(self.spec),
                timeout=self.timeout,
                allow_nonfinite=self.allow_nonfinite,
            )
        return WorkerSession(
            self.spec, timeout=self.timeout, allow_nonfinite=self.allow_nonfinite
        ).start()

    def _worker(self) -> WorkerSession:
        """The live worker session, started if needed; calls go through _using_worker,
        which holds the shared worker's lock for the whole call."""
        entry = self._hold.entry(self, self._registry_key)
        with entry.lock:
            return entry.live_session(self._start_session)

    @contextlib.contextmanager
    def _using_worker(self) -> Iterator[WorkerSession]:
        """The live worker session, held for one call (one request and its reply).

        Every call to the worker goes through here, so a worker shared with other
        calculators is used by one caller at a time.
        """
        entry = self._hold.entry(self, self._registry_key)
        with entry.lock:
            yield entry.live_session(self._start_session)

    def close(self) -> None:
        """Let go of the worker; it stops when the last calculator sharing it lets go.

        A calculator of its own (``shared=False``) stops its worker. A closed
        calculator can still compute: it joins (or starts) a worker again.
        """
        self._hold.leave()

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the hold on a worker: a copy shares it, or starts its own."""
        state = self.__dict__.copy()
        del state["_hold"], state["_call_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # A copy pickled before provenance existed reads it afresh on first access.
        self.__dict__.setdefault("_provenance", None)
        self.__dict__.setdefault("max_memory", None)
        self.__dict__.setdefault("memory_report", None)
        self._hold = shared.Holder()
        self._call_lock = threading.RLock()

    def __enter__(self) -> RootstockCalculator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- ASE interface ----------------------------------------------------------------

    def get_property(self, name: str, atoms: Any = None, allow_calculation: bool = True) -> Any:
        """ASE's get_property, except that an extra the model may fill is not refused
        before this instance knows what its model computes.

        One thread at a time: ASE keeps the last structure and its results on the
        calculator, so threads sharing one calculator would read each other's.
        """
        with self._call_lock:
            return self._get_property(name, atoms, allow_calculation)

    def _get_property(self, name: str, atoms: Any, allow_calculation: bool) -> Any:
        if (
            name in EXTRA_PROPERTIES
            and self._model_extras is None
            and allow_calculation
            and (atoms is not None or self.atoms is not None)
        ):
            # ASE checks implemented_properties before calculating, and only the
            # worker knows the extras: one calculation (asking for this one too)
            # settles it, and the call below then finds the value in the results.
            previous = self._extras_requested
            self._request_extras((name,))
            try:
                super().get_property("energy", atoms, allow_calculation)
            except WorkerError:
                self._extras_requested = previous
                raise
        return super().get_property(name, atoms, allow_calculation)

    def _request_extras(self, names: Any) -> None:
        wanted = set(self._extras_requested)
        wanted.update(n for n in names if n in EXTRA_PROPERTIES)
        if self._model_extras is not None:
            wanted &= set(self._model_extras)
        self._extras_requested = tuple(n for n in EXTRA_PROPERTIES if n in wanted)

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
        """Send the structure to the worker; store energy, forces, stress and extras.

        Stress (3-D periodic cells) and extras (``magmoms``, ...) are computed from
        the first time they are asked for onwards.
        """
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
        requested = self._extras_requested
        if not _BASE_SET.issuperset(properties):
            self._request_extras(properties)
        text = info_json(atoms.info)
        try:
            with self._using_worker() as session:
                reply = session.compute(
                    atoms, text, want_stress, self._extras_requested, timeout=self.timeout
                )
        except WorkerError:
            # An extra that made the model (or its check) fail is not asked for again.
            self._extras_requested = requested
            raise
        self._info_json = text
        energy = float(reply.energy)
        results: dict[str, Any] = {
            "energy": energy,
            "free_energy": energy,
            "forces": reply.forces,
        }
        if reply.extra:
            try:
                self._read_extra(reply, results)
            except ProtocolError:
                self._hold.distrust(session)
                raise
        if self._model_extras is None:
            # A sharer learns the report another sharer's INIT brought; None marks a
            # worker too old to report its model.
            self._learn_model(self._hold.model_report)
        if want_stress:
            results["stress"] = stress_from_virial(reply.virial, atoms)
        self.results = results
        # Where ASE and quacc (results["parameters"]) keep a calculator's metadata. A
        # user's weights file removed since the worker loaded it costs the record, not
        # the result.
        with contextlib.suppress(OSError):
            self.parameters["provenance"] = self.provenance

    def calculate_batch(
        self,
        images: Iterable[Any],
        properties: Iterable[str] = ("energy", "forces", "stress"),
        batch_size: BatchSize | None = None,
        errors: str = "raise",
        max_memory: float | int | str | None = None,
    ) -> list[Any]:
        """Evaluate many structures, one round trip per chunk; results in input order.

        ``results[i]`` is a dict with the keys and units ``calc.results`` would have
        for ``images[i]`` (see docs/calculator.md); ``calc.results`` is left alone.
        ``batch_size`` and ``max_memory`` override the calculator's for this call.
        """
        from rootstock.runtime.batch import calculate_batch

        return calculate_batch(self, images, properties, batch_size, errors, max_memory)

    def _read_extra(self, reply: ForceReply, results: dict[str, Any]) -> None:
        """Free energy, the model report and extras' values from the FORCEREADY extra JSON."""
        extra = reply.extra_json()
        if "free_energy" in extra:
            results["free_energy"] = float(extra["free_energy"])
        if "model" in extra:
            self._learn_model(extra["model"])
        natoms = len(reply.forces)
        for name in EXTRA_PROPERTIES:
            if name in extra:
                try:
                    results[name] = extra_array(name, extra[name], natoms)
                except ValueError as exc:
                    raise ProtocolError(f"the worker sent a malformed extra: {exc}") from None

    def _learn_model(self, report: Any) -> None:
        """Take the worker's model report: its dtype and the extras it fills."""
        if report is None:
            self._model_extras = ()
            return
        if not isinstance(report, dict):
            raise ProtocolError(f"the worker's model report is not a JSON object: {report!r}")
        extras = report.get("extras") or []
        dtype = report.get("dtype")
        # A worker vendored before the device was reported sends none: None, unknown.
        device = report.get("device")
        if not isinstance(extras, list) or not all(
            value is None or isinstance(value, str) for value in (dtype, device)
        ):
            raise ProtocolError(f"malformed model report from the worker: {report!r}")
        self._hold.model_report = report
        # Names this client does not know (a newer worker) are left out.
        self._model_extras = tuple(n for n in EXTRA_PROPERTIES if n in extras)
        self.implemented_properties = BASE_PROPERTIES + self._model_extras
        self.model_dtype = dtype
        self.model_device = device
        self._request_extras(())
