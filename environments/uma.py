"""UMA, Meta FAIR Chemistry's universal models for atoms (package ``fairchem-core``).

The named checkpoints live in the gated Hugging Face repository ``facebook/UMA``.
Accept its licence there, make a token readable (``HF_TOKEN``), and fetch with
``rootstock add uma-s-1p1 --kwarg task=omat`` on a node with network; the fetch
phase (:func:`download`) takes the checkpoint *and* the element-reference files
that ``setup()`` later reads offline.

``uma:custom`` loads a user's own ``MLIPInferenceCheckpoint`` (a fine-tune, say)
through :func:`setup_from_path`, with fairchem's own ``load_predict_unit``.

How it is proven here: ``tests/mlip/test_family_uma.py`` builds this env, saves a
tiny randomly initialised UMA model (the eSCN-MD mixture-of-linear-experts
backbone with a dataset-specific energy/forces/stress head), loads it through
``uma:custom`` on the CPU with ``inference_settings="traineval"``, compares
``RootstockCalculator`` with the same model run in-process, and checks forces and
stress against the energy by finite differences. It also shows that a named
checkpoint that was never fetched fails offline with an error naming the files,
and, against a hub cache laid out by hand, that :func:`download` resolves every
file an offline ``setup()`` reads. The real weights are not exercised here: a GPU
node needs the licence accepted, a token, and ``rootstock add`` run once with
network; it then runs fairchem's default inference settings (UMA Nitro where the
checkpoint allows it, else merged experts compiled with TF32 matrix multiplies).

UMA has one head per DFT task, and the caller must choose it: ``task`` is one of
``omat`` (inorganic materials), ``omol`` (molecules), ``oc20`` (catalysis),
``odac`` (MOFs) or ``omc`` (molecular crystals); a custom checkpoint offers the
tasks its ``tasks_config`` declares. There is deliberately no default;
verification uses ``VERIFY_KWARGS`` (``omat``, which fits the bulk metal reference
structure). ``inference_settings`` (a fairchem preset name: ``default``,
``traineval``, ``batch``, ...) is passed to fairchem unchanged; on a CPU use
``traineval`` or ``batch``, since the default compiles the model.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "fairchem-core>=2.24",
#     "torch",
#     "ase>=3.23",
#     "numpy",
# ]
# ///

CHECKPOINTS = {
    "uma-s-1p1": "uma-s-1p1",
    "uma-m-1p1": "uma-m-1p1",
    "uma:custom": "a fairchem MLIPInferenceCheckpoint file (torch.save)",
}

# What each checkpoint is (docs/environments.md): from fairchem-core 2.24, its README
# (access to the UMA repository, the model table) and
# fairchem/core/calculate/pretrained_models.json (repository and file). The README says
# only that checkpoint licences "vary by application area", so no licence is given here.
CHECKPOINT_INFO = {
    "uma-s-1p1": {
        "gated": "https://huggingface.co/facebook/UMA",
        "source": "https://huggingface.co/facebook/UMA (checkpoints/uma-s-1p1.pt)",
    },
    "uma-m-1p1": {
        "gated": "https://huggingface.co/facebook/UMA",
        "source": "https://huggingface.co/facebook/UMA (checkpoints/uma-m-1p1.pt)",
        "summary": "UMA medium: the most accurate UMA model, slower and larger than uma-s",
    },
    "uma:custom": {
        "summary": "a user's own fairchem MLIPInferenceCheckpoint (setup_from_path())",
    },
}

VERIFY_KWARGS = {
    "uma-s-1p1": {"task": "omat"},
    "uma-m-1p1": {"task": "omat"},
}

TASKS = ("omat", "omol", "oc20", "odac", "omc")


def _upstream(checkpoint):
    named = sorted(c for c in CHECKPOINTS if not c.endswith(":custom"))
    if checkpoint not in named:
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {named}")
    return CHECKPOINTS[checkpoint]


def _require_task(what, task, choices):
    if task is None:
        raise ValueError(f"{what} needs task=<one of {', '.join(choices)}>")
    if task not in choices:
        raise ValueError(f"{what} has no task {task!r}; choose one of {', '.join(choices)}")


def download(checkpoint, **kw):
    """Fetch everything an offline ``setup()`` reads into fairchem's cache.

    ``get_predict_unit`` resolves a model name with ``resolve_checkpoint``, which
    downloads the checkpoint and, for the UMA checkpoints, the isolated-atom and
    formation element references (``references/iso_atom_elem_refs.yaml`` and
    ``references/form_elem_refs.yaml``); calling it here fetches the same files
    without building the model.
    """
    from fairchem.core.calculate.pretrained_mlip import resolve_checkpoint

    return resolve_checkpoint(_upstream(checkpoint)).path


def setup(checkpoint, device="cuda", task=None, inference_settings="default", **kw):
    """Return a FAIRChemCalculator for ``checkpoint`` with the head for ``task``."""
    name = _upstream(checkpoint)
    _require_task(checkpoint, task, TASKS)
    from fairchem.core import FAIRChemCalculator, pretrained_mlip

    try:
        predictor = pretrained_mlip.get_predict_unit(
            name, inference_settings=inference_settings, device=device
        )
    except FileNotFoundError as err:
        # huggingface_hub's offline miss (LocalEntryNotFoundError) names no file.
        raise FileNotFoundError(
            f"{checkpoint}: {_hub_files(name)} not in fairchem's cache "
            f"{pretrained_mlip.CACHE_DIR} (workers run offline); fetch them with "
            f"`rootstock add {checkpoint}` on a node with network access"
        ) from err
    return FAIRChemCalculator(predictor, task_name=task, **kw)


def _hub_files(name):
    """What get_predict_unit reads for ``name``, as ``repo: path, path`` (for messages)."""
    from fairchem.core.calculate.pretrained_mlip import _MODEL_CKPTS

    entry = _MODEL_CKPTS.checkpoints[name]
    files = [f"{entry.subfolder}/{entry.filename}" if entry.subfolder else entry.filename]
    for refs in (entry.atom_refs, entry.form_elem_refs):
        if refs:
            files.append(f"{refs['subfolder']}/{refs['filename']}")
    return f"the weights and references ({entry.repo_id}: {', '.join(files)}) are"


def setup_from_path(path, device="cuda", task=None, inference_settings="default", **kw):
    """Return a FAIRChemCalculator for the ``MLIPInferenceCheckpoint`` at ``path``.

    ``task`` must be one of the datasets the checkpoint's tasks declare.
    """
    from fairchem.core import FAIRChemCalculator
    from fairchem.core.units.mlip_unit import load_predict_unit

    # Loaded first: only the checkpoint knows which tasks (datasets) it serves.
    predictor = load_predict_unit(str(path), inference_settings=inference_settings, device=device)
    _require_task(f"uma:custom ({path})", task, sorted(predictor.dataset_to_tasks))
    return FAIRChemCalculator(predictor, task_name=task, **kw)
