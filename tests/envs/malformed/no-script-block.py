"""Malformed on purpose: no PEP 723 block."""


CHECKPOINTS = {
    "toy-1": "toy",
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
