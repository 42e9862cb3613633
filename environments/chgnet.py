"""CHGNet (Deng et al. 2023): a crystal-graph potential with charge information.

The ``chgnet`` wheel on PyPI ships all three pretrained weight files under
``chgnet/pretrained/``, so every checkpoint here loads offline: nothing is
downloaded at setup time. ``chgnet:custom`` loads a user's own fine-tuned
``.pth.tar`` through :func:`setup_from_path`.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "chgnet>=0.4.2",
#     "torch",
#     "ase>=3.23",
#     "numpy",
# ]
# ///

CHECKPOINTS = {
    "chgnet-0.3.0": "0.3.0",
    "chgnet-0.2.0": "0.2.0",
    "chgnet-r2scan": "r2scan",
    "chgnet:custom": None,
}

# What each checkpoint is (docs/environments.md): from the chgnet 0.4.2 wheel's
# LICENSE, README and chgnet/pretrained/*/README.md.
CHECKPOINT_INFO = {
    "chgnet-0.3.0": {
        "licence": "BSD-3-Clause-LBNL",
        "gated": None,
        "source": "the chgnet wheel on PyPI (chgnet/pretrained/0.3.0/)",
        "citation": "10.1038/s42256-023-00716-3",
        "training_data": "MPtrj",
        "summary": "CHGNet 0.3.0, the package's default MPtrj-pretrained universal potential",
    },
    "chgnet-0.2.0": {
        "licence": "BSD-3-Clause-LBNL",
        "gated": None,
        "source": "the chgnet wheel on PyPI (chgnet/pretrained/0.2.0/)",
        "citation": "10.1038/s42256-023-00716-3",
        "training_data": "MPtrj",
        "summary": "the weights of the CHGNet paper; deprecated upstream, kept for compatibility",
    },
    "chgnet-r2scan": {
        "licence": "BSD-3-Clause-LBNL",
        "gated": None,
        "source": "the chgnet wheel on PyPI (chgnet/pretrained/r2scan/)",
        "training_data": "MP-r2SCAN",
        "summary": "CHGNet 0.3.0 transfer-learned to the r2SCAN functional",
    },
    "chgnet:custom": {
        "summary": "a user's own CHGNet weights (.pth.tar), loaded through setup_from_path()",
    },
}


def _calculator(model, device, **kw):
    from chgnet.model.dynamics import CHGNetCalculator

    return CHGNetCalculator(model=model, use_device=device, **kw)


def setup(checkpoint, device="cuda", **kw):
    """Return a CHGNetCalculator for one of the wheel's pretrained models.

    ``CHGNet.load`` resolves the version to the file inside the wheel and applies
    ``mlp_out_bias=True`` for 0.2.0 itself; extra ``kw`` go to CHGNetCalculator
    (e.g. ``on_isolated_atoms``, ``stress_weight``).
    """
    if checkpoint == "chgnet:custom":
        raise ValueError("chgnet:custom needs a weights file: use setup_from_path(path)")
    if checkpoint not in CHECKPOINTS:
        choices = sorted(c for c in CHECKPOINTS if not c.endswith(":custom"))
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {choices}")
    from chgnet.model import CHGNet

    model = CHGNet.load(model_name=CHECKPOINTS[checkpoint], use_device="cpu", verbose=False)
    return _calculator(model, device, **kw)


def setup_from_path(path, device="cuda", mlp_out_bias=False, **kw):
    """Return a CHGNetCalculator for a CHGNet weights file (``.pth.tar``).

    Weights derived from CHGNet 0.2.0 were trained with an output-layer bias:
    load them with ``mlp_out_bias=True`` or the energies are wrong.
    """
    from chgnet.model import CHGNet

    try:
        model = CHGNet.from_file(str(path), mlp_out_bias=bool(mlp_out_bias))
    except RuntimeError as exc:
        if "mlp_out" not in str(exc):
            raise
        # The bias layers are either in the file or not; say which flag the file needs.
        needed = "Unexpected key" in str(exc)
        raise ValueError(
            f"{path} was trained {'with' if needed else 'without'} an output-layer bias: "
            f"load it with mlp_out_bias={needed}"
        ) from exc
    return _calculator(model, device, **kw)


def _one_at_a_time(calc, atoms, properties):
    # The single-call path, for items the batched call cannot take; same numbers as
    # the worker's own loop.
    atoms = atoms.copy()
    atoms.calc = calc
    out = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    if "stress" in properties and atoms.pbc.all():
        out["stress"] = atoms.get_stress()
    for name in properties:
        if name not in out and name != "stress" and calc.results.get(name) is not None:
            out[name] = calc.results[name]
    return out


def evaluate_batch(calc, atoms_list, properties):
    """Evaluate many structures in one ``CHGNet.predict_graph`` call per batch.

    Returns energy (eV, total: CHGNet predicts eV/atom), forces (eV/Å), stress
    (eV/Å^3: the model's GPa times the calculator's ``stress_weight``, as
    CHGNetCalculator converts it) and magmoms, per item. Non-periodic items go
    through the calculator one at a time (CHGNet needs a cell, so they fail there as
    they would alone); an item whose graph cannot be built (an isolated atom under
    ``on_isolated_atoms="error"``) gets its exception in its slot. A failure inside
    the model's forward fails the whole call, and the worker then runs the items one
    at a time to find the one that fails.
    """
    from pymatgen.io.ase import AseAtomsAdaptor

    model = calc.model
    results = [None] * len(atoms_list)
    graphs, where = [], []
    for index, atoms in enumerate(atoms_list):
        if not atoms.pbc.all():
            try:
                results[index] = _one_at_a_time(calc, atoms, properties)
            except Exception as exc:  # the model's own error, reported for this item
                results[index] = exc
            continue
        try:
            graphs.append(model.graph_converter(AseAtomsAdaptor.get_structure(atoms)))
        except Exception as exc:  # the graph converter's own error, for this item
            results[index] = exc
            continue
        where.append(index)
    if graphs:
        # task and flags as CHGNetCalculator.calculate passes them.
        predictions = model.predict_graph(
            graphs,
            task="efsm",
            return_site_energies=calc.return_site_energies,
            batch_size=len(graphs),
        )
        if len(graphs) == 1:
            predictions = [predictions]
        for index, prediction in zip(where, predictions, strict=True):
            natoms = len(atoms_list[index])
            extensive = natoms if model.is_intensive else 1
            out = {
                "energy": float(prediction["e"]) * extensive,
                "forces": prediction["f"],
                "magmoms": prediction["m"],
            }
            if "stress" in properties:
                out["stress"] = prediction["s"] * calc.stress_weight
            if calc.return_site_energies:
                out["energies"] = prediction["site_energies"]
            out["free_energy"] = out["energy"]
            results[index] = out
    return results
