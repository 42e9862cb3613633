"""Test env: setup() raises, as a model with missing weights would."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase"]
# ///

CHECKPOINTS = {"broken-setup": "nothing"}


def setup(checkpoint, device="cuda", **kw):
    """Always fail, with a message the test looks for."""
    raise RuntimeError("broken on purpose: the weights file is missing")
