"""Malformed on purpose: setup_from_path() takes no path."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
    "toy:custom": None,
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()


def setup_from_path(*, device="cuda", **kw):
    return setup("toy-1", device)
