"""ASE's effective-medium theory (EMT): the fast, dependency-light model for tests.

EMT has no weights to fetch, so the ``emt`` checkpoint works offline anywhere.
It covers Al, Cu, Ag, Au, Ni, Pd, Pt (and H, C, N, O loosely), which is why the
built-in verification structure is a metal.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "ase>=3.23",
#     "numpy>=1.24",
# ]
# ///

CHECKPOINTS = {
    "emt": "ase.calculators.emt.EMT",
}

# What the checkpoint is (docs/environments.md): the licence is ASE's (its wheel's
# metadata); EMT's parameters are in ase/calculators/emt.py, so there is nothing to fetch.
CHECKPOINT_INFO = {
    "emt": {
        "licence": "LGPL-2.1-or-later",
        "gated": None,
        "source": "ASE itself (ase.calculators.emt): no weight files",
        "summary": "effective-medium theory for Al, Cu, Ag, Au, Ni, Pd and Pt",
    },
}


def setup(checkpoint, device="cuda", **kw):
    """Return an ASE EMT calculator; ``device`` is accepted and ignored (EMT is CPU-only)."""
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {checkpoint!r}; this env serves only 'emt'")
    from ase.calculators.emt import EMT

    return EMT(**kw)
