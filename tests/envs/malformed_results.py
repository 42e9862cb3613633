"""Test env: EMT whose results are broken on request, as a buggy model would return them.

``setup()`` keywords name a property and how to break it (see :func:`broken`);
``atoms.info["malformed"]`` (a JSON object of the same keys) overrides them for one
calculation, so one warm worker can return a bad result and then a good one.

- ``energy``: ``string``, ``object``, ``nan``, ``inf``, ``vector`` (shape (2,));
- ``forces``: ``n4``, ``n2`` (shape (n, 4) / (n, 2)), ``scalar``, ``flat`` (3n,),
  ``string``, ``nan``, ``inf``;
- ``stress``: ``len5``, ``4x4``, ``3x3`` (valid: matgl returns 3x3), ``nan``, ``inf``;
- ``charges``: ``object`` (cannot be serialised), ``nan``;
- ``free_energy``: ``string``.

``setup_error`` makes ``setup()`` raise ValueError with that text. More stand
for crashes: ``segfault_in_setup`` (a real SIGSEGV inside
``setup()``), ``exit_in_setup`` (``os._exit`` with that code inside ``setup()``,
after a line on stderr) and ``exit_leaving_thread`` in ``atoms.info["malformed"]``
(the model calls ``sys.exit`` while a non-daemon thread it started keeps the
process alive after the worker closed its socket). ``rogue_reply`` in
``atoms.info["malformed"]`` stands for a model that corrupts the worker's socket:
it writes a ``FORCEREADY`` declaring 2**24 atoms there itself, then stalls.
``sleep`` (seconds, in ``atoms.info["malformed"]``) stalls one calculation.
``own_plumbing`` makes the calculator replace ASE's ``get_forces`` so the worker
takes its public-API path.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase", "numpy"]
# ///

CHECKPOINTS = {"malformed-results": "emt-with-broken-results"}

PROPERTIES = ("energy", "free_energy", "forces", "stress", "charges")


def broken(prop, kind, good, natoms):
    """The broken value of ``prop`` for ``kind``; ``good`` is what EMT computed (or None)."""
    import numpy as np

    if kind == "nan" or kind == "inf":
        bad = np.nan if kind == "nan" else np.inf
        if prop == "energy":
            return bad
        value = np.array(good if good is not None else np.zeros(natoms), dtype=float)
        value.reshape(-1)[1] = bad
        return value
    table = {
        ("energy", "string"): lambda: str(good),
        ("energy", "object"): lambda: object(),
        ("energy", "vector"): lambda: np.array([good, good]),
        ("free_energy", "string"): lambda: "free",
        ("forces", "n4"): lambda: np.zeros((natoms, 4)),
        ("forces", "n2"): lambda: np.zeros((natoms, 2)),
        ("forces", "scalar"): lambda: 0.5,
        ("forces", "flat"): lambda: np.asarray(good).reshape(-1),
        ("forces", "string"): lambda: "forces",
        ("stress", "len5"): lambda: np.zeros(5),
        ("stress", "4x4"): lambda: np.zeros((4, 4)),
        ("charges", "object"): lambda: [object()] * natoms,
    }
    if (prop, kind) == ("stress", "3x3"):
        from ase.stress import voigt_6_to_full_3x3_stress

        return voigt_6_to_full_3x3_stress(good)
    return table[prop, kind]()


def setup(
    checkpoint,
    device="cuda",
    segfault_in_setup=False,
    own_plumbing=False,
    setup_error=None,
    exit_in_setup=None,
    **kw,
):
    """EMT with the properties named in ``kw`` (or in atoms.info) broken as asked."""
    import sys
    import threading
    import time

    from ase.calculators.calculator import all_changes
    from ase.calculators.emt import EMT

    if setup_error:
        raise ValueError(setup_error)
    if exit_in_setup is not None:
        import os

        print("malformed-results: exiting inside setup()", file=sys.stderr, flush=True)
        os._exit(int(exit_in_setup))
    if segfault_in_setup:
        import ctypes

        ctypes.string_at(0)  # a real segfault, as in a model's native extension
    defaults = {k: v for k, v in kw.items() if k in PROPERTIES}

    class BrokenEMT(EMT):
        implemented_properties = (*EMT.implemented_properties, "charges")

        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, list(properties), system_changes)
            asked = {**defaults, **(self.atoms.info.get("malformed") or {})}
            time.sleep(asked.pop("sleep", 0))  # a stalled model, for a kill mid-call
            if asked.pop("rogue_reply", False):
                write_rogue_reply()
                time.sleep(600)
            if asked.pop("exit_leaving_thread", False):
                threading.Thread(target=time.sleep, args=(600,)).start()
                sys.exit(4)
            self.results["charges"] = [0.0] * len(self.atoms)
            for prop, kind in asked.items():
                good = self.results.get(prop)
                self.results[prop] = broken(prop, kind, good, len(self.atoms))

    class OwnPlumbingEMT(BrokenEMT):
        def get_forces(self, atoms=None):
            return self.get_property("forces", atoms)

    return OwnPlumbingEMT() if own_plumbing else BrokenEMT()


def write_rogue_reply():
    """Write a FORCEREADY header declaring 2**24 atoms on the worker's connected socket."""
    import os
    import socket
    import stat
    import struct

    frame = b"FORCEREADY".ljust(12) + struct.pack("=di", 0.0, 1 << 24)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family == socket.AF_UNIX and sock.getpeername():
                sock.sendall(frame)
        except OSError:
            pass
        finally:
            sock.close()
