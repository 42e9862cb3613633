"""Malformed on purpose: a :custom id whose value is a number."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
    "toy:custom": 3,
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()


def setup_from_path(path, device="cuda", **kw):
    return setup("toy-1", device)
