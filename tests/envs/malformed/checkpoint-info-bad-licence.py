"""Malformed on purpose: a licence that is a phrase, not an SPDX id."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

CHECKPOINT_INFO = {
    "toy-1": {
        "summary": "a toy",
        "licence": "MIT License",
    },
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
