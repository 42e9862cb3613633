"""Test env: EMT whose energy also depends on ``atoms.info["charge"]``.

Extra knobs read from ``atoms.info`` (tests only): ``sleep`` (seconds to stall
before computing, to kill the worker mid-calculation) and ``fail`` (a message to
raise as a model error).
"""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase"]
# ///

CHECKPOINTS = {"charge-emt": "emt-plus-charge"}

# eV per unit of charge added to the EMT energy.
CHARGE_SHIFT = 0.75


def setup(checkpoint, device="cuda", **kw):
    """Return an EMT calculator shifted by CHARGE_SHIFT * info["charge"]."""
    import time

    from ase.calculators.calculator import all_changes
    from ase.calculators.emt import EMT

    class ChargeEMT(EMT):
        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            info = atoms.info if atoms is not None else {}
            if info.get("sleep"):
                time.sleep(float(info["sleep"]))
            if info.get("fail"):
                raise ValueError(str(info["fail"]))
            super().calculate(atoms, list(properties), system_changes)
            shift = CHARGE_SHIFT * float(info.get("charge", 0.0))
            self.results["energy"] += shift
            self.results["free_energy"] += shift

    return ChargeEMT(**kw)
