"""Test env: declares a :custom id but (after a bad hotfix) lost setup_from_path()."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase"]
# ///

CHECKPOINTS = {"nohook-1": "one", "nohook:custom": None}


def setup(checkpoint, device="cuda", **kw):
    """Plain EMT."""
    from ase.calculators.emt import EMT

    return EMT()
