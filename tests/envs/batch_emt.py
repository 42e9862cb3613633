"""Test env: EMT with an ``evaluate_batch`` hook that records every call it gets.

Each hook call appends one line to the file named by the ``record`` setup keyword:
the number of structures and the properties asked for, so a test can see that the
worker handed it whole chunks. A chunk holding an element EMT has no parameters for
fails as a whole (as a native batch would), so the worker must re-run that chunk
one structure at a time to name the failing index.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase", "numpy"]
# ///

CHECKPOINTS = {"batch-emt": "emt-with-a-batch-hook"}


def setup(checkpoint, device="cuda", record=None, delay=0.0, **kw):
    """Return ASE's EMT, remembering where the hook records its calls.

    ``delay`` (seconds) is added to every model call, single or batched, so that
    concurrent clients of one pooled worker queue behind it and get merged.
    """
    import time

    from ase.calculators.emt import EMT

    class SlowEMT(EMT):
        def calculate(self, *args, **kwargs):
            time.sleep(delay)
            super().calculate(*args, **kwargs)

    calc = SlowEMT() if delay else EMT()
    calc.batch_record = record
    calc.batch_delay = delay
    return calc


def evaluate_batch(calc, atoms_list, properties):
    """EMT on each structure, in one call; a structure EMT cannot do fails the batch."""
    import json
    import time

    import numpy as np
    from ase.calculators.emt import EMT, parameters

    unknown = sorted(
        {s for atoms in atoms_list for s in atoms.get_chemical_symbols()} - set(parameters)
    )
    if calc.batch_record:
        with open(calc.batch_record, "a", encoding="utf-8") as fh:
            line = {"size": len(atoms_list), "properties": list(properties)}
            fh.write(json.dumps({**line, "failed": bool(unknown)}) + "\n")
    time.sleep(getattr(calc, "batch_delay", 0.0))
    if unknown:
        raise ValueError(f"no EMT parameters for {', '.join(unknown)} in this batch")
    results = []
    for atoms in atoms_list:
        own = atoms.copy()
        own.calc = EMT()
        result = {"energy": own.get_potential_energy(), "forces": np.array(own.get_forces())}
        if "stress" in properties:
            result["stress"] = np.array(own.get_stress())
        results.append(result)
    return results
