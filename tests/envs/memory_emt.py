"""Test env: EMT with an ``evaluate_batch`` hook whose memory grows with its atoms.

For ``batch_size="auto"`` (docs/calculator.md, "Chunks that fit in memory"). Each
hook call holds ``bytes_per_atom`` bytes for every atom it was given, in a buffer
written page by page, so the worker's resident memory really grows with the call;
and a call holding more than ``oom_atoms`` atoms (0: no limit) raises MemoryError,
as a model that ran out of memory would. Every call appends its structure and atom
counts to the file named by ``record``, so a test sees what the worker ran.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase", "numpy"]
# ///

CHECKPOINTS = {"memory-emt": "emt-whose-batches-cost-memory"}


def setup(checkpoint, device="cuda", bytes_per_atom=0, oom_atoms=0, record=None, **kw):
    """Return ASE's EMT, remembering what its batches cost."""
    from ase.calculators.emt import EMT

    calc = EMT()
    calc.memory_costs = (int(bytes_per_atom), int(oom_atoms), record)
    return calc


def evaluate_batch(calc, atoms_list, properties):
    """EMT on each structure, in one call that holds memory in proportion to its atoms."""
    import json

    import numpy as np
    from ase.calculators.emt import EMT

    bytes_per_atom, oom_atoms, record = calc.memory_costs
    atoms_in_call = sum(len(atoms) for atoms in atoms_list)
    if record:
        with open(record, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"structures": len(atoms_list), "atoms": atoms_in_call}) + "\n")
    if oom_atoms and atoms_in_call > oom_atoms:
        raise MemoryError(f"{atoms_in_call} atoms in one call; this model fits {oom_atoms}")
    # np.ones writes every page: resident memory, not only reserved address space.
    held = np.ones(bytes_per_atom * atoms_in_call // 8)
    results = []
    for atoms in atoms_list:
        own = atoms.copy()
        own.calc = EMT()
        result = {"energy": own.get_potential_energy(), "forces": np.array(own.get_forces())}
        if "stress" in properties:
            result["stress"] = np.array(own.get_stress())
        results.append(result)
    del held
    return results
