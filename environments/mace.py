"""MACE foundation models (Batatia et al.): MACE-MP-0, MACE-MPA-0 and MACE-OMAT-0.

Not exercised by the test suite here (weights come from a hub): the checkpoints
are downloaded from the MACE GitHub releases on first use, so run
``rootstock add <id> --no-verify`` on a node with network access first.
MACE-OMAT-0 is released under the Academic Software License; check it fits
your users before adding it.

``mace:custom`` loads a user's own ``.model`` file through :func:`setup_from_path`.
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
    """Return a MACECalculator for a user's own ``.model`` file (e.g. a fine-tune)."""
    from mace.calculators import MACECalculator

    return MACECalculator(model_paths=str(path), device=device, default_dtype=default_dtype, **kw)
