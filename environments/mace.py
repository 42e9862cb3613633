"""MACE foundation models (Batatia et al.): MACE-MP-0, MACE-MPA-0 and MACE-OMAT-0.

The ``mace-torch`` wheel ships no weights: the foundation checkpoints are
downloaded from the MACE GitHub releases on first use, so run
``rootstock add <id> --no-verify`` on a node with network access first.
MACE-OMAT-0 is released under the Academic Software License; check it fits
your users before adding it.

``mace:custom`` loads a user's own ``.model`` file (a whole pickled model, as
``mace_run_train`` saves it) through :func:`setup_from_path`. That path is how
the family is proven here, offline: ``tests/mlip/test_family_mace.py`` builds a
small randomly initialised ``ScaleShiftMACE`` in this env, loads it through
``mace:custom`` and checks RootstockCalculator against the in-process model
(float64) and forces and stress against the energy. The foundation ids share
that code path (``mace_mp`` builds the same ``MACECalculator``) but their
weights are not exercised offline.

On a GPU node the env needs a CUDA build of torch (supplied at build time; the
block below stays a plain ``torch``). cuEquivariance kernels are optional: add
the ``mace-torch[cueq,cueq-cuda-12]`` extras (``cuequivariance-torch`` and
``cuequivariance-ops-torch-cu12``) in a cluster variant of this file and pass
``enable_cueq=True`` through ``setup_kwargs``.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "mace-torch>=0.3.10",
#     "torch",
#     "ase>=3.23",
#     "numpy",
# ]
# ///

# id -> the name mace.calculators.mace_mp() takes
CHECKPOINTS = {
    "mace-mp-0-small": "small",
    "mace-mp-0-medium": "medium",
    "mace-mp-0-large": "large",
    "mace-mpa-0-medium": "medium-mpa-0",
    "mace-omat-0-medium": "medium-omat-0",
    "mace:custom": None,
}

# What each checkpoint is (docs/environments.md): from mace-torch 0.3.16, its README's
# foundation-model table (training data, licence) and mace/calculators/
# foundations_models.py (download URLs, the ASL notice, the MACE-MP-0 citation).
CHECKPOINT_INFO = {
    "mace-mp-0-small": {
        "licence": "MIT",
        "gated": None,
        "source": "https://github.com/ACEsuit/mace-mp/releases/download/mace_mp_0/2023-12-10-mace-128-L0_energy_epoch-249.model",
        "citation": "arXiv:2401.00096",
        "training_data": "MPtrj",
        "summary": "MACE-MP-0 small: universal potential for 89 elements, PBE+U",
    },
    "mace-mp-0-medium": {
        "licence": "MIT",
        "gated": None,
        "source": "https://github.com/ACEsuit/mace-mp/releases/download/mace_mp_0/2023-12-03-mace-128-L1_epoch-199.model",
        "citation": "arXiv:2401.00096",
        "training_data": "MPtrj",
        "summary": "MACE-MP-0 medium: universal potential for 89 elements, PBE+U",
    },
    "mace-mp-0-large": {
        "licence": "MIT",
        "gated": None,
        "source": "https://github.com/ACEsuit/mace-mp/releases/download/mace_mp_0/MACE_MPtrj_2022.9.model",
        "citation": "arXiv:2401.00096",
        "training_data": "MPtrj",
        "summary": "MACE-MP-0 large: universal potential for 89 elements, PBE+U",
    },
    "mace-mpa-0-medium": {
        "licence": "MIT",
        "gated": None,
        "source": "https://github.com/ACEsuit/mace-mp/releases/download/mace_mpa_0/mace-mpa-0-medium.model",
        "training_data": "MPtrj + sAlex",
        "summary": "MACE-MPA-0: improved accuracy and high-pressure stability over MACE-MP-0",
    },
    "mace-omat-0-medium": {
        "licence": "custom:https://github.com/gabor1/ASL",
        "gated": None,
        "source": "https://github.com/ACEsuit/mace-mp/releases/download/mace_omat_0/mace-omat-0-medium.model",
        "training_data": "OMAT",
        "summary": "MACE-OMAT-0: 89 elements, PBE+U; Academic Software License, no commercial use",
    },
    "mace:custom": {
        "summary": "a user's own MACE model (.model), loaded through setup_from_path()",
    },
}


def _upstream(checkpoint):
    if checkpoint not in CHECKPOINTS or CHECKPOINTS[checkpoint] is None:
        choices = sorted(c for c, name in CHECKPOINTS.items() if name is not None)
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {choices}")
    return CHECKPOINTS[checkpoint]


def download(checkpoint, **kw):
    """Fetch the weights into the cache without building a model; return their path."""
    from mace.calculators.foundations_models import download_mace_mp_checkpoint

    return download_mace_mp_checkpoint(_upstream(checkpoint))


def setup(checkpoint, device="cuda", default_dtype="float64", **kw):
    """Return a MACECalculator for a foundation checkpoint.

    ``default_dtype`` defaults to float64, which MACE recommends for geometry
    optimisation and phonons; pass ``float32`` for faster molecular dynamics.
    """
    from mace.calculators import mace_mp

    return mace_mp(model=_upstream(checkpoint), device=device, default_dtype=default_dtype, **kw)


def setup_from_path(path, device="cuda", default_dtype="float64", **kw):
    """Return a MACECalculator for a user's own ``.model`` file (e.g. a fine-tune).

    ``default_dtype`` defaults to float64, as for :func:`setup`; a float32 model is
    converted to it.
    """
    from mace.calculators import MACECalculator

    # A one-item list, not a str: MACECalculator globs a str, so a name holding "[" or
    # "*" would load some other file, or none.
    paths = [str(path)]
    return MACECalculator(model_paths=paths, device=device, default_dtype=default_dtype, **kw)


def _one_at_a_time(calc, atoms, properties):
    # The single-call path, for items or setups the batched call does not cover;
    # same numbers as the worker's own loop.
    atoms = atoms.copy()
    atoms.calc = calc
    out = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    if "stress" in properties and atoms.pbc.all():
        out["stress"] = atoms.get_stress()
    for name in properties:
        if name not in out and name != "stress" and calc.results.get(name) is not None:
            out[name] = calc.results[name]
    return out


def _each_alone(calc, atoms_list, properties):
    results = []
    for atoms in atoms_list:
        try:
            results.append(_one_at_a_time(calc, atoms, properties))
        except Exception as exc:  # the model's own error, reported for this item
            results.append(exc)
    return results


# What the batched path computes; asking for more (charges, dipole) takes the loop.
_BATCHED = {"energy", "forces", "stress", "energies"}


def evaluate_batch(calc, atoms_list, properties):
    """Evaluate many structures in one MACE forward pass per model on a batch.

    Each item becomes an ``AtomicData`` exactly as MACECalculator builds it (same
    dtype, cutoff, element table, head); MACE's DataLoader collates them, each model
    of the calculator runs once on the batch, and its outputs are split per graph and
    averaged over the models as the calculator does. Returns energy (eV), forces
    (eV/Å), stress (Voigt, eV/Å^3, 3-D periodic items only) and per-atom energies.
    A compiled model, atomic stresses, a non-``MACE`` model (dipole, polarisability
    heads) and properties beyond those go through the calculator one structure at a
    time.
    """
    import torch
    from ase.stress import full_3x3_to_voigt_6_stress
    from mace import data as mace_data
    from mace.tools import torch_geometric, torch_tools

    special = calc.use_compile or calc.compute_atomic_stresses or calc.model_type != "MACE"
    if special or not set(properties) <= _BATCHED:
        return _each_alone(calc, atoms_list, properties)
    keyspec = mace_data.KeySpecification(
        info_keys=calc.info_keys, arrays_keys={**calc.arrays_keys, calc.charges_key: "charges"}
    )
    results = [None] * len(atoms_list)
    graphs, where = [], []
    with torch_tools.default_dtype(calc.default_dtype):
        for index, atoms in enumerate(atoms_list):
            try:
                config = mace_data.config_from_atoms(
                    atoms, key_specification=keyspec, head_name=calc.head
                )
                graphs.append(
                    mace_data.AtomicData.from_config(
                        config, z_table=calc.z_table, cutoff=calc.r_max, heads=calc.available_heads
                    )
                )
            except Exception as exc:  # e.g. an element outside the model's table
                results[index] = exc
                continue
            where.append(index)
    if not graphs:
        return results
    loader = torch_geometric.dataloader.DataLoader(graphs, batch_size=len(graphs), shuffle=False)
    base = next(iter(loader)).to(calc.device)
    sums = None
    for model in calc.models:
        batch = base.clone()
        dtype = next(model.parameters()).dtype
        for key in batch.keys:
            value = batch[key]
            if torch.is_tensor(value) and torch.is_floating_point(value):
                batch[key] = value.to(dtype=dtype)
        out = model(batch.to_dict(), compute_stress=True, training=False)
        parts = {
            name: out[name].detach()
            for name in ("energy", "forces", "stress", "node_energy")
            if out.get(name) is not None
        }
        sums = parts if sums is None else {name: sums[name] + parts[name] for name in sums}
    mean = {name: (value / len(calc.models)).cpu() for name, value in sums.items()}
    counts = (base["ptr"][1:] - base["ptr"][:-1]).tolist()
    forces = mean["forces"].split(counts)
    node_energy = mean["node_energy"].split(counts) if "node_energy" in mean else None
    energy_unit = calc.energy_units_to_eV
    force_unit = energy_unit / calc.length_units_to_A
    stress_unit = energy_unit / calc.length_units_to_A**3
    for k, index in enumerate(where):
        energy = float(mean["energy"][k]) * energy_unit
        item = {"energy": energy, "free_energy": energy, "forces": forces[k].numpy() * force_unit}
        if "stress" in mean and "stress" in properties and atoms_list[index].pbc.all():
            item["stress"] = full_3x3_to_voigt_6_stress(mean["stress"][k].numpy()) * stress_unit
        if node_energy is not None:
            item["energies"] = node_energy[k].numpy() * energy_unit
        results[index] = item
    return results
