"""Orb-v3 (Orbital Materials), package ``orb-models``.

Not exercised by the test suite here (weights come from a hub): each loader in
``orb_models.forcefield.pretrained`` downloads its weights on first use, so run
``rootstock add <id> --no-verify`` on a node with network access first.

The ``conservative`` models compute forces and stress as gradients of the energy
(smooth, for MD); ``direct`` ones predict them (faster). ``inf`` means every
neighbour within 6 Å, ``20`` at most twenty.
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
}


def _loader(checkpoint):
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {sorted(CHECKPOINTS)}")
    from orb_models.forcefield import pretrained

    return pretrained.ORB_PRETRAINED_MODELS[CHECKPOINTS[checkpoint]]


def download(checkpoint, **kw):
    """Fetch the weights into cached_path's cache without building a model."""
    import inspect

    from cached_path import cached_path

    # Each loader's weights URL is the default of its weights_path parameter;
    # cached_path is what the loader itself would call.
    url = inspect.signature(_loader(checkpoint)).parameters["weights_path"].default
    return str(cached_path(url))


def setup(checkpoint, device="cuda", precision="float32-high", **kw):
    """Return an ORBCalculator; ``precision`` may be float32-high, float32-highest or float64."""
    from orb_models.forcefield.calculator import ORBCalculator

    model = _loader(checkpoint)(device=device, precision=precision)
    return ORBCalculator(model, device=device, **kw)
