"""Malformed on purpose: a citation that is neither a DOI nor an arXiv id."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

CHECKPOINT_INFO = {
    "toy-1": {
        "licence": "MIT",
        "citation": "Toy et al. 2024",
    },
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
