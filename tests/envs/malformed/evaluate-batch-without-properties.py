"""Malformed on purpose: evaluate_batch() takes no properties argument."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()


def evaluate_batch(calc, atoms_list):
    return [calc for _ in atoms_list]
