"""Malformed on purpose: gated is True, not the URL where access is requested."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

CHECKPOINT_INFO = {
    "toy-1": {
        "gated": True,
    },
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
