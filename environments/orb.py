"""Orb-v3 (Orbital Materials), package ``orb-models`` 0.5.x.

Pinned below 0.6: orb-models 0.6 requires Python >= 3.12, which the machines
this env is built and tested on cannot build (their envs are Python 3.11).

The ``conservative`` models compute forces and stress as gradients of the energy
(smooth, for MD); ``direct`` ones predict them (faster). ``inf`` means every
neighbour within 6 Å (up to 120), ``20`` at most twenty.

The named ids' weights come from Orbital Materials' S3 bucket: each loader in
``orb_models.forcefield.pretrained`` downloads them on first use, so run
``rootstock add <id>`` on a node with network access first (``download()``
fetches them into cached_path's cache, where the offline worker finds them).

``orb:custom`` loads a user's own weights (a state dict saved with
``torch.save(model.state_dict(), path)``, as ORB's fine-tuning writes it) through
:func:`setup_from_path`. An orb-models 0.5 state dict holds no architecture or
neighbour cap, so ``architecture=`` names the pretrained key it was trained from::

    RootstockCalculator(checkpoint="orb:custom", weights="my-orb.pt",
                        setup_kwargs={"architecture": "orb-v3-conservative-inf-omat"})

How this is proven here: ``tests/mlip/test_family_orb.py`` builds randomly
initialised conservative and direct orb-v3 models in this env (full size: the
architecture's size knobs change the state dict's shapes, so a smaller model would
not load into any named architecture), loads them through ``orb:custom``, checks
that energy, forces and stress through RootstockCalculator equal the same model
run in-process, and runs the physics check through the same calculator, all on
CPU and offline. The named ids' own weights are never fetched by the tests.

On a GPU node: a CUDA build of torch, network access once per id for
``rootstock add``, and, because ``torch.compile`` is ORB's default there, a C
compiler for Triton (or pass ``compile=False``). On CPU the model is not compiled.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "orb-models>=0.5,<0.6",
#     "torch",
#     "ase>=3.23",
#     "numpy",
# ]
# ///

# id -> key of orb_models.forcefield.pretrained.ORB_PRETRAINED_MODELS
CHECKPOINTS = {
    "orb-v3-conservative-inf-omat": "orb-v3-conservative-inf-omat",
    "orb-v3-conservative-20-omat": "orb-v3-conservative-20-omat",
    "orb-v3-direct-20-omat": "orb-v3-direct-20-omat",
    "orb-v3-conservative-inf-mpa": "orb-v3-conservative-inf-mpa",
    "orb:custom": None,
}

# What each checkpoint is (docs/environments.md): from orb-models 0.5.5, its README
# (licence, citation) and orb_models/forcefield/pretrained.py (URLs, training data).
CHECKPOINT_INFO = {
    "orb-v3-conservative-inf-omat": {
        "licence": "Apache-2.0",
        "gated": None,
        "source": "https://orbitalmaterials-public-models.s3.us-west-1.amazonaws.com/forcefields/orb-v3/orb-v3-conservative-inf-omat-20250404.ckpt",
        "citation": "arXiv:2504.06231",
        "training_data": "OMAT",
        "summary": "Orb-v3, conservative, every neighbour within 6 Å",
    },
    "orb-v3-conservative-20-omat": {
        "licence": "Apache-2.0",
        "gated": None,
        "source": "https://orbitalmaterials-public-models.s3.us-west-1.amazonaws.com/forcefields/orb-v3/orb-v3-conservative-20-omat-20250404.ckpt",
        "citation": "arXiv:2504.06231",
        "training_data": "OMAT",
        "summary": "Orb-v3, conservative, at most 20 neighbours",
    },
    "orb-v3-direct-20-omat": {
        "licence": "Apache-2.0",
        "gated": None,
        "source": "https://orbitalmaterials-public-models.s3.us-west-1.amazonaws.com/forcefields/orb-v3/orb-v3-direct-20-omat-20250404.ckpt",
        "citation": "arXiv:2504.06231",
        "training_data": "OMAT",
        "summary": "Orb-v3, direct forces and stress, at most 20 neighbours",
    },
    "orb-v3-conservative-inf-mpa": {
        "licence": "Apache-2.0",
        "gated": None,
        "source": "https://orbitalmaterials-public-models.s3.us-west-1.amazonaws.com/forcefields/orb-v3/orb-v3-conservative-inf-mpa-20250404.ckpt",
        "citation": "arXiv:2504.06231",
        "training_data": "MPTraj + Alexandria",
        "summary": "Orb-v3, conservative, every neighbour within 6 Å",
    },
    "orb:custom": {
        "summary": "a user's own orb-v3 state dict, loaded through setup_from_path()",
    },
}

# How verification judges forces and stress against the energy.
VERIFY_CHECKS = {
    # Forces and stress come from their own heads, not from the energy's gradient.
    "orb-v3-direct-20-omat": {"forces": "direct", "stress": "direct"},
    # Keeping only the 20 nearest of the ~84 neighbours within 6 Å makes the energy
    # jump whenever the 20th and 21st swap; on the 8-atom reference they sit in one
    # shell, ~0.01 Å apart, so the finite-difference steps cross such jumps. With the
    # same random weights, forces came out 0.18x the derivative of the energy under
    # the 20 cap and 0.995x under the 120 cap (tests/mlip/test_family_orb.py).
    "orb-v3-conservative-20-omat": {"energy": "non-smooth"},
}

# architecture= key -> (kind, neighbour cap, extra architecture kwargs), as each
# key's loader in orb_models.forcefield.pretrained (0.5.5) builds it.
_ARCHITECTURES = {
    "orb-v3-conservative-inf-omat": ("conservative", 120, {}),
    "orb-v3-conservative-20-omat": ("conservative", 20, {}),
    "orb-v3-direct-inf-omat": ("direct", 120, {}),
    "orb-v3-direct-20-omat": ("direct", 20, {}),
    "orb-v3-conservative-inf-mpa": ("conservative", 120, {}),
    "orb-v3-conservative-20-mpa": ("conservative", 20, {}),
    "orb-v3-direct-inf-mpa": ("direct", 120, {}),
    "orb-v3-direct-20-mpa": ("direct", 20, {}),
    "orb-v3-conservative-omol": (
        "conservative",
        120,
        {"has_charge_spin_cond": True, "has_stress": False},
    ),
    "orb-v3-direct-omol": ("direct", 120, {"has_charge_spin_cond": True, "has_stress": False}),
}


def _loader(checkpoint):
    if CHECKPOINTS.get(checkpoint) is None:
        choices = sorted(c for c, name in CHECKPOINTS.items() if name is not None)
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {choices}")
    from orb_models.forcefield import pretrained

    return pretrained.ORB_PRETRAINED_MODELS[CHECKPOINTS[checkpoint]]


def _compiles(device, compile):
    # ORB compiles by default on every device but MPS; on CPU that needs a C++
    # toolchain and minutes of warm-up for no gain, so CPU runs eager unless asked.
    if compile is not None:
        return bool(compile)
    return not str(device).lower().startswith("cpu")


def download(checkpoint, **kw):
    """Fetch the weights into cached_path's cache without building a model."""
    import inspect

    from cached_path import cached_path

    # Each loader's weights URL is the default of its weights_path parameter;
    # cached_path is what the loader itself would call.
    url = inspect.signature(_loader(checkpoint)).parameters["weights_path"].default
    return str(cached_path(url))


def setup(checkpoint, device="cuda", precision="float32-high", compile=None, **kw):
    """Return an ORBCalculator; ``precision`` may be float32-high, float32-highest or float64.

    ``compile`` (torch.compile) defaults to ORB's choice off CPU and to False on CPU.
    """
    from orb_models.forcefield.calculator import ORBCalculator

    model = _loader(checkpoint)(
        device=device, precision=precision, compile=_compiles(device, compile)
    )
    return ORBCalculator(model, device=device, **kw)


def setup_from_path(
    path,
    device="cuda",
    architecture=None,
    precision="float32-high",
    compile=None,
    **kw,
):
    """Return an ORBCalculator for a user's orb-v3 state dict at ``path``.

    ``architecture`` (required) is the pretrained key the weights match, for
    example ``orb-v3-conservative-inf-omat``: it fixes the model class
    (conservative or direct) and the neighbour cap, which the file does not record.
    ``precision`` and ``compile`` are as for :func:`setup`.
    """
    if architecture not in _ARCHITECTURES:
        given = "no architecture" if architecture is None else f"architecture {architecture!r}"
        raise ValueError(
            f"orb:custom needs architecture= naming the pretrained model the weights "
            f"match; got {given}; choose one of {sorted(_ARCHITECTURES)}"
        )
    kind, neighbours, extra = _ARCHITECTURES[architecture]

    import torch
    from orb_models.forcefield import pretrained
    from orb_models.forcefield.atomic_system import SystemConfig
    from orb_models.forcefield.calculator import ORBCalculator
    from orb_models.forcefield.load import load_forcefield_state_dict
    from orb_models.utils import set_torch_precision

    # The same steps as pretrained.load_model, which would hide missing heads.
    build = getattr(pretrained, f"orb_v3_{kind}_architecture")
    config = SystemConfig(radius=6.0, max_num_neighbors=neighbours)
    model = build(device="cpu", system_config=config, **extra)
    model = model.to(set_torch_precision(precision))
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises whatever its unpickler or zip reader hits
        raise ValueError(
            f"cannot read {path} as a torch state dict: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        bad = load_forcefield_state_dict(model, state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{path} does not fit architecture {architecture!r}: {exc}") from exc
    if bad.missing_keys:
        # ORB's strict load lets a head be missing and leaves it random.
        heads = sorted({key.split(".")[1] for key in bad.missing_keys})
        raise ValueError(
            f"{path} does not fit architecture {architecture!r}: it has no weights "
            f"for the {', '.join(heads)} head(s); pick the architecture it was trained as"
        )
    model = model.to(device).eval()
    for parameter in model.parameters():
        parameter.requires_grad = False
    if _compiles(device, compile):
        model.compile(mode="default", dynamic=True)
    return ORBCalculator(model, device=device, **kw)


def _one_at_a_time(calc, atoms, properties):
    # The single-call path, for models the batched call does not cover; same numbers
    # as the worker's own loop.
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
    """Evaluate many structures in one ORB ``predict`` call on ``batch_graphs``.

    Each item's graph is built as ORBCalculator builds it (its system config,
    neighbour cap, edge method, device); the outputs are split per graph. Returns
    energy (eV), forces (eV/Å) and, for 3-D periodic items of a model with a stress
    head, stress (Voigt, eV/Å^3): the gradient ones for a conservative calculator,
    the heads' for a direct one, as ORBCalculator picks them. A charge- and
    spin-conditioned model goes through the calculator one structure at a time.
    """
    from orb_models.forcefield.atomic_system import ase_atoms_to_atom_graphs
    from orb_models.forcefield.base import batch_graphs

    if calc.expects_charge_and_spin:
        results = []
        for atoms in atoms_list:
            try:
                results.append(_one_at_a_time(calc, atoms, properties))
            except Exception as exc:  # the model's own error, reported for this item
                results.append(exc)
        return results
    model = calc.model
    if calc.conservative:
        forces_name = model.grad_forces_name
        stress_name = model.grad_stress_name if model.has_stress else None
    else:
        forces_name = "forces" if "forces" in model.heads else None
        stress_name = "stress" if "stress" in model.heads else None
    energy_name = getattr(model, "energy_name", "energy")
    results = [None] * len(atoms_list)
    graphs, where = [], []
    for index, atoms in enumerate(atoms_list):
        try:
            graphs.append(
                ase_atoms_to_atom_graphs(
                    atoms,
                    system_config=calc.system_config,
                    max_num_neighbors=calc.max_num_neighbors,
                    edge_method=calc.edge_method,
                    half_supercell=calc.half_supercell,
                    device=calc.device,
                )
            )
        except Exception as exc:  # the graph build's own error, for this item
            results[index] = exc
            continue
        where.append(index)
    if not graphs:
        return results
    batch = batch_graphs(graphs).to(calc.device)
    out = model.predict(batch)
    counts = batch.n_node.cpu().tolist()
    energies = out[energy_name].detach().cpu().reshape(-1).numpy()
    forces = out[forces_name].detach().cpu().split(counts) if forces_name else None
    stress = out[stress_name].detach().cpu().reshape(len(counts), 6) if stress_name else None
    for k, index in enumerate(where):
        energy = float(energies[k])
        item = {"energy": energy, "free_energy": energy}
        if forces is not None:
            item["forces"] = forces[k].numpy()
        if stress is not None and "stress" in properties and atoms_list[index].pbc.all():
            item["stress"] = stress[k].numpy()
        results[index] = item
    return results
