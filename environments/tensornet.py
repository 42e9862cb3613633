"""TensorNet foundation potentials trained on MatPES, through MatGL.

Not exercised by the test suite here (weights come from a hub): ``matgl.load_model``
downloads the model files on first use into MatGL's cache, so run
``rootstock add <id> --no-verify`` on a node with network access first. The
weights are small (about a million parameters), so there is no separate
``download()`` hook: setting the model up on the CPU is the download.

MatGL's graph backend (DGL or PyG, depending on the release) must match the
torch build; check MatGL's installation notes if the build fails.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "matgl>=1.2",
#     "torch",
#     "ase>=3.23",
#     "numpy",
# ]
# ///

CHECKPOINTS = {
    "tensornet-matpes-pbe-v2025.1": "TensorNet-MatPES-PBE-v2025.1-PES",
    "tensornet-matpes-r2scan-v2025.1": "TensorNet-MatPES-r2SCAN-v2025.1-PES",
}


def setup(checkpoint, device="cuda", **kw):
    """Return a MatGL PESCalculator for ``checkpoint`` (extra ``kw`` go to PESCalculator)."""
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {sorted(CHECKPOINTS)}")
    import matgl
    import torch
    from matgl.ext.ase import PESCalculator

    # MatGL builds its graphs on torch's default device; the worker hosts one model.
    torch.set_default_device(device)
    potential = matgl.load_model(CHECKPOINTS[checkpoint])
    return PESCalculator(potential, **kw)
