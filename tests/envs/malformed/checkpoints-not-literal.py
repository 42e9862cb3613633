"""Malformed on purpose: CHECKPOINTS built by a comprehension."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

SIZES = ["small", "large"]
CHECKPOINTS = {f"toy-{size}": size for size in SIZES}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
