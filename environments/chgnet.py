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
