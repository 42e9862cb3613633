"""UMA, Meta FAIR Chemistry's universal models for atoms (package ``fairchem-core``).

Not exercised by the test suite here (weights come from a hub): the checkpoints
live in the gated Hugging Face repository ``facebook/UMA``. Accept its licence
there, make a token readable (``HF_TOKEN``), and fetch with
``rootstock add uma-s-1p1 --no-verify --kwarg task=omat`` on a node with network.

UMA has one head per DFT task, and the caller must choose it: ``task`` is one of
``omat`` (inorganic materials), ``omol`` (molecules), ``oc20`` (catalysis),
``odac`` (MOFs) or ``omc`` (molecular crystals). There is deliberately no
default; verification uses ``VERIFY_KWARGS`` (``omat``, which fits the bulk
metal reference structure).
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "fairchem-core>=2.3",
#     "torch",
#     "ase>=3.23",
#     "numpy",
# ]
# ///

CHECKPOINTS = {
    "uma-s-1p1": "uma-s-1p1",
    "uma-m-1p1": "uma-m-1p1",
}

VERIFY_KWARGS = {
    "uma-s-1p1": {"task": "omat"},
    "uma-m-1p1": {"task": "omat"},
}

TASKS = ("omat", "omol", "oc20", "odac", "omc")


def _upstream(checkpoint):
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {sorted(CHECKPOINTS)}")
    return CHECKPOINTS[checkpoint]


def download(checkpoint, **kw):
    """Fetch the checkpoint into the Hugging Face cache without building a model."""
    from fairchem.core.calculate.pretrained_mlip import pretrained_checkpoint_path_from_name

    return pretrained_checkpoint_path_from_name(_upstream(checkpoint))


def setup(checkpoint, device="cuda", task=None, **kw):
    """Return a FAIRChemCalculator for ``checkpoint`` with the head for ``task``."""
    name = _upstream(checkpoint)
    if task is None:
        raise ValueError(f"{checkpoint} needs task=<one of {', '.join(TASKS)}>")
    if task not in TASKS:
        raise ValueError(f"{checkpoint} has no task {task!r}; choose one of {', '.join(TASKS)}")
    from fairchem.core import FAIRChemCalculator, pretrained_mlip

    predictor = pretrained_mlip.get_predict_unit(name, device=device)
    return FAIRChemCalculator(predictor, task_name=task, **kw)
