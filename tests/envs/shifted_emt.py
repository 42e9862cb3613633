"""Test env: EMT moved by a known amount, for committee tests.

``shifted-emt`` is EMT with its energy raised by ``ENERGY_SHIFT`` and its forces and
stress scaled by ``FORCE_SCALE``, so a committee of it and ``emt`` has spreads known
in closed form. ``plain-emt`` is EMT as it is. Both take, per worker, ``delay``
(seconds slept in every calculation) and ``trace_file`` (each calculation appends
``{"checkpoint", "pid", "start", "end"}`` as one JSON line, wall-clock seconds), and
per structure ``atoms.info["sleep"]`` (seconds to stall, to kill the worker
mid-calculation) and ``atoms.info["fail"]`` (a message to raise as a model error).
"""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase", "numpy"]
# ///

CHECKPOINTS = {
    "shifted-emt": "emt-plus-a-constant-with-forces-times-1.01",
    "plain-emt": "emt-with-delay-and-trace-knobs",
}

ENERGY_SHIFT = 3.0
FORCE_SCALE = 1.01


def setup(checkpoint, device="cuda", delay=0.0, trace_file=None, **kw):
    """EMT, shifted and scaled for ``shifted-emt``, as it is for ``plain-emt``."""
    import json
    import os
    import time

    from ase.calculators.calculator import all_changes
    from ase.calculators.emt import EMT

    shift, scale = (ENERGY_SHIFT, FORCE_SCALE) if checkpoint == "shifted-emt" else (0.0, 1.0)

    class ShiftedEMT(EMT):
        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            start = time.time()
            info = atoms.info if atoms is not None else {}
            time.sleep(float(delay) + float(info.get("sleep", 0.0)))
            if info.get("fail"):
                raise ValueError(str(info["fail"]))
            super().calculate(atoms, list(properties), system_changes)
            for name in ("energy", "free_energy"):
                self.results[name] += shift
            for name in ("forces", "stress"):
                if name in self.results:
                    self.results[name] = self.results[name] * scale
            if trace_file:
                line = {"checkpoint": checkpoint, "pid": os.getpid(), "start": start,
                        "end": time.time()}  # fmt: skip
                with open(trace_file, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(line) + "\n")

    return ShiftedEMT(**kw)
