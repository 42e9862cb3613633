"""TensorNet foundation potentials trained on MatPES, through MatGL.

The named checkpoints come from a hub: ``matgl.load_model`` downloads the model
files (the ``materialyze`` organisation on Hugging Face) on first use into MatGL's
cache, so run ``rootstock add <id> --no-verify`` on a node with network access
first. The weights are small (about a million parameters), so there is no separate
``download()`` hook: setting the model up on the CPU is the download.
``tensornet:custom`` loads a user's own model (e.g. a fine-tune) from the
directory that ``matgl.apps.pes.Potential.save(dir)`` writes.

MatGL 4.x builds its graphs with PyTorch Geometric only (the DGL backend is gone;
``matgl.set_backend`` is a no-op), and ``torch-geometric`` is pure Python, so the
env needs no compiled graph extension. MatGL runs in float32.

MatGL's ``PESCalculator`` reports stress in GPa unless told otherwise; ASE expects
eV/Å³, so both hooks pass ``stress_unit="eV/A3"`` (a caller may still override it).

How it is proven here: ``tests/mlip/test_family_tensornet.py`` builds this env,
saves a small randomly initialised TensorNet with ``Potential.save``, runs it
through ``tensornet:custom`` on the CPU and compares it with the same model run
in-process, then checks forces and stress against finite differences of the
energy (the old GPa stress fails that check, 160× too large). No pretrained model
is loaded. A GPU node needs a CUDA build of torch in this env; the optional
``matgl[ops]`` extra (nvalchemi-toolkit-ops) adds warp kernels that TensorNet
picks up by itself when it is installed.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "matgl>=4.1",
#     "torch",
#     "ase>=3.23",
#     "numpy",
# ]
# ///

CHECKPOINTS = {
    "tensornet-matpes-pbe-v2025.1": "TensorNet-MatPES-PBE-v2025.1-PES",
    "tensornet-matpes-r2scan-v2025.1": "TensorNet-MatPES-r2SCAN-v2025.1-PES",
    "tensornet:custom": None,
}

# What each checkpoint is (docs/environments.md): from matgl 4.1.2, its README
# (citations for the pretrained models) and matgl/utils/io.py (the materialyze org).
CHECKPOINT_INFO = {
    "tensornet-matpes-pbe-v2025.1": {
        "source": "https://huggingface.co/materialyze/TensorNet-MatPES-PBE-v2025.1-PES",
        "citation": "10.48550/arXiv.2306.06482",
        "training_data": "MatPES (PBE)",
    },
    "tensornet-matpes-r2scan-v2025.1": {
        "source": "https://huggingface.co/materialyze/TensorNet-MatPES-r2SCAN-v2025.1-PES",
        "citation": "10.48550/arXiv.2306.06482",
        "training_data": "MatPES (r2SCAN)",
    },
    "tensornet:custom": {
        "summary": "a user's own MatGL potential, from the directory Potential.save() writes",
    },
}


def _use_device(device):
    import torch

    # MatGL builds its models and graphs on torch's default device; the worker
    # hosts one model, so setting it process-wide is safe.
    torch.set_default_device(device)


def _calculator(potential, **kw):
    from matgl.ext.ase import PESCalculator

    kw.setdefault("stress_unit", "eV/A3")
    return PESCalculator(potential, **kw)


def setup(checkpoint, device="cuda", **kw):
    """Return a MatGL PESCalculator for ``checkpoint`` (extra ``kw`` go to PESCalculator)."""
    if checkpoint == "tensornet:custom":
        raise ValueError("tensornet:custom needs a model directory: use setup_from_path(path)")
    if checkpoint not in CHECKPOINTS:
        choices = sorted(c for c in CHECKPOINTS if not c.endswith(":custom"))
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {choices}")
    import matgl

    _use_device(device)
    return _calculator(matgl.load_model(CHECKPOINTS[checkpoint]), **kw)


def setup_from_path(path, device="cuda", **kw):
    """Return a MatGL PESCalculator for a saved Potential directory.

    ``path`` is what ``Potential.save(dir)`` wrote (``model.json``, ``model.pt``,
    ``state.pt``). Extra ``kw`` go to PESCalculator.
    """
    from pathlib import Path

    from matgl.apps.pes import Potential

    _use_device(device)
    # An absolute path never matches MatGL's "owner/name" or bare-name patterns,
    # so a directory that is not a saved model fails here instead of being
    # looked up on the Hugging Face Hub.
    return _calculator(Potential.load(Path(path).absolute()), **kw)
