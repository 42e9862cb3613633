"""SevenNet (Park et al. 2024): a scalable equivariant GNN potential (package ``sevenn``).

Only the checkpoints whose weights the ``sevenn`` wheel ships under
``sevenn/pretrained_potentials/`` are listed, so setup never downloads. Newer
models (``7net-omat``, ``7net-mf-ompa``, ``7net-omni``) are fetched from the
network on first use; add them in a separate env on clusters that allow it.

``sevennet-mf-0`` is multi-fidelity: it has a PBE head and an r2SCAN head, and
the caller must choose one with ``modal="PBE"`` or ``modal="R2SCAN"``. There is
deliberately no default; verification uses ``VERIFY_KWARGS``.

``sevennet:custom`` loads a user's own SevenNet checkpoint (the ``.pth`` that
``sevenn`` training writes: a dict with ``config`` and ``model_state_dict``)
through :func:`setup_from_path`.

How it is proven here, offline: ``tests/mlip/test_family_sevennet.py`` runs the
shipped ``sevennet-0`` weights, and a small randomly initialised model built with
``sevenn``'s own model builder and loaded through ``sevennet:custom``, through
RootstockCalculator against the same model in-process (SevenNet runs float32),
and checks forces and stress against the energy.

On a GPU node the env needs a CUDA build of torch (supplied at build time; the
block below stays a plain ``torch``). The cuEquivariance tensor-product kernels
are optional: add the ``sevenn[cueq12]`` extra in a cluster variant of this file
and pass ``enable_cueq=True`` through ``setup_kwargs``.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "sevenn>=0.13.0",
#     "torch",
#     "ase>=3.23",
#     "numpy",
# ]
# ///

CHECKPOINTS = {
    "sevennet-0": "7net-0",
    "sevennet-0-22may2024": "7net-0_22May2024",
    "sevennet-l3i5": "7net-l3i5",
    "sevennet-mf-0": "7net-mf-0",
    "sevennet:custom": None,
}

# What each checkpoint is (docs/environments.md): from the sevenn 0.13.0 wheel's
# LICENSE, README (citations) and sevenn/pretrained_potentials/.
CHECKPOINT_INFO = {
    "sevennet-0": {
        "licence": "MIT",
        "gated": None,
        "source": "the sevenn wheel on PyPI (sevenn/pretrained_potentials/SevenNet_0__11Jul2024/)",
        "citation": "10.1021/acs.jctc.4c00190",
    },
    "sevennet-0-22may2024": {
        "licence": "MIT",
        "gated": None,
        "source": "the sevenn wheel on PyPI (sevenn/pretrained_potentials/SevenNet_0__22May2024/)",
        "citation": "10.1021/acs.jctc.4c00190",
    },
    "sevennet-l3i5": {
        "licence": "MIT",
        "gated": None,
        "source": "the sevenn wheel on PyPI (sevenn/pretrained_potentials/SevenNet_l3i5/)",
        "citation": "10.1021/acs.jctc.4c00190",
    },
    "sevennet-mf-0": {
        "licence": "MIT",
        "gated": None,
        "source": "the sevenn wheel on PyPI (sevenn/pretrained_potentials/SevenNet_MF_0/)",
        "citation": "10.1021/jacs.4c14455",
        "summary": "multi-fidelity SevenNet with a PBE and an r2SCAN head (modal=)",
    },
    "sevennet:custom": {
        "summary": "a user's own SevenNet checkpoint (.pth), loaded through setup_from_path()",
    },
}

VERIFY_KWARGS = {
    "sevennet-mf-0": {"modal": "PBE"},
}

# The heads of sevennet-mf-0 as the user names them -> as the checkpoint names them.
MF_0_MODALS = {"PBE": "PBE", "R2SCAN": "R2SCAN"}


def setup(checkpoint, device="cuda", modal=None, **kw):
    """Return a SevenNetCalculator for a checkpoint the wheel ships.

    ``modal`` selects the head of ``sevennet-mf-0`` (``PBE`` or ``R2SCAN``,
    case-insensitive) and is rejected for single-fidelity checkpoints.
    """
    if CHECKPOINTS.get(checkpoint) is None:
        choices = sorted(c for c, name in CHECKPOINTS.items() if name is not None)
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {choices}")
    if checkpoint == "sevennet-mf-0":
        choices = " or ".join(MF_0_MODALS)
        if modal is None:
            # Python's own words for a missing argument: verification then points the
            # maintainer at VERIFY_KWARGS.
            raise TypeError(
                "setup() missing 1 required keyword argument: 'modal' (sevennet-mf-0 "
                f"needs modal={choices}: which DFT functional's head to use)"
            )
        key = str(modal).upper()
        if key not in MF_0_MODALS:
            raise ValueError(f"sevennet-mf-0 has no modal {modal!r}; choose {choices}")
        kw["modal"] = MF_0_MODALS[key]
    elif modal is not None:
        raise ValueError(f"{checkpoint} is single-fidelity; it takes no modal argument")
    from sevenn.calculator import SevenNetCalculator

    return SevenNetCalculator(model=CHECKPOINTS[checkpoint], device=device, **kw)


def setup_from_path(path, device="cuda", **kw):
    """Return a SevenNetCalculator for a user's own SevenNet checkpoint file.

    A multi-fidelity checkpoint needs ``modal=`` (the head); SevenNet itself
    rejects a missing or unknown one, naming the heads the file has.
    """
    import os

    # sevenn treats a name that is not a file as a pretrained model's name, so a
    # wrong path must fail here rather than load the shipped weights.
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SevenNet checkpoint {path} is not a file")
    from sevenn.calculator import SevenNetCalculator

    return SevenNetCalculator(model=str(path), file_type="checkpoint", device=device, **kw)


def evaluate_batch(calc, atoms_list, properties):
    """Evaluate many structures in one SevenNet forward pass on a batch of graphs.

    Each item's graph is built as SevenNetCalculator builds it (same cutoff and
    modality); the model runs once on the batch with ``set_is_batch_data(True)`` and
    is put back in single-structure mode afterwards. Returns energy (eV), forces
    (eV/Å), stress (Voigt, eV/Å^3, sign and order as the calculator's) and the
    per-atom energies. An item with an element the model does not know gets the
    calculator's own error in its slot.
    """
    import sevenn._keys as KEY
    from sevenn.atom_graph_data import AtomGraphData
    from sevenn.train.dataload import unlabeled_atoms_to_graph
    from torch_geometric.loader import DataLoader

    results = [None] * len(atoms_list)
    graphs, where = [], []
    for index, atoms in enumerate(atoms_list):
        try:
            calc.set_atoms(atoms)  # the calculator's own species check
            data = AtomGraphData.from_numpy_dict(
                unlabeled_atoms_to_graph(atoms, calc.cutoff, with_shift=False)
            )
        except Exception as exc:  # the species check or graph build, for this item
            results[index] = exc
            continue
        if calc.modal:
            data[KEY.DATA_MODALITY] = calc.modal
        graphs.append(data)
        where.append(index)
    if not graphs:
        return results
    batch = next(iter(DataLoader(graphs, batch_size=len(graphs), shuffle=False)))
    batch = batch.to(calc.device)
    calc.model.set_is_batch_data(True)
    try:
        output = calc.model(batch)
    finally:
        calc.model.set_is_batch_data(False)
    counts = output[KEY.NUM_ATOMS].tolist()
    energies = output[KEY.PRED_TOTAL_ENERGY].detach().cpu().numpy()
    forces = output[KEY.PRED_FORCE].detach().cpu().split(counts)
    atomic = output[KEY.ATOMIC_ENERGY].detach().cpu().reshape(-1).split(counts)
    # SevenNet's stress is the negative, in (xx, yy, zz, xy, yz, zx) order.
    stress = (-output[KEY.PRED_STRESS]).detach().cpu().numpy()[:, [0, 1, 2, 4, 5, 3]]
    for k, index in enumerate(where):
        energy = float(energies[k])
        out = {
            "energy": energy,
            "free_energy": energy,
            "forces": forces[k].numpy(),
            "energies": atomic[k].numpy(),
        }
        if "stress" in properties and atoms_list[index].pbc.all():
            out["stress"] = stress[k]
        results[index] = out
    return results
