"""The in-env side of ``benchmarks/cold_start.py``: a worker's start, one phase at a time.

Run by an env's own Python, with the environment a worker of that env gets:

    python -I _cold_start_env.py ENV_SOURCE CHECKPOINT DEVICE SPAWNED_AT

It does what a worker does before its first answer, in the same order, and prints
one JSON line of seconds:

- ``interpreter``: from SPAWNED_AT (the parent's wall clock just before the spawn) to
  this script's first line: the interpreter and its site-packages start-up;
- ``imports``: numpy, ASE and the worker's own (vendored) rootstock modules, then the
  env's ``env_source.py`` itself;
- ``setup``: the env's ``setup(checkpoint, device)``;
- ``first_call``: the first energy of an 8-atom Cu cell.
"""

import time

STARTED = time.time()

import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402


def main() -> None:
    source, checkpoint, device, spawned_at = sys.argv[1:5]
    t0 = time.perf_counter()
    import numpy  # noqa: F401
    from ase.build import bulk

    import rootstock.worker.main  # noqa: F401

    spec = importlib.util.spec_from_file_location("env_source", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["env_source"] = module
    spec.loader.exec_module(module)
    t1 = time.perf_counter()
    calc = module.setup(checkpoint, device)
    t2 = time.perf_counter()
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((1, 1, 2))
    atoms.calc = calc
    energy = float(atoms.get_potential_energy())
    t3 = time.perf_counter()
    phases = {
        "interpreter": STARTED - float(spawned_at),
        "imports": t1 - t0,
        "setup": t2 - t1,
        "first_call": t3 - t2,
        "energy": energy,
    }
    sys.__stdout__.write(json.dumps(phases) + "\n")


if __name__ == "__main__":
    main()
