"""Test env: EMT that records each ``setup()`` call, and can be made slow.

Every ``setup()`` appends one JSON line to the file named by the ``count_file``
setup keyword: the worker's pid, its parent's pid (the engine worker that
started it) and ``CUDA_VISIBLE_DEVICES``. The scale-out tests count model loads
per engine worker from it and read the GPU each worker was pinned to. ``delay``
(seconds) is slept in every calculation, so a chunk is still running when a test
kills its engine worker. With ``trace_file``, every calculation first appends its
pid and start time there, so a test can kill an engine worker while it is surely
inside a task.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase", "numpy"]
# ///

CHECKPOINTS = {"count-emt": "emt-that-counts-its-setup-calls"}


def setup(checkpoint, device="cuda", count_file=None, delay=0.0, trace_file=None, **kw):
    """Return ASE's EMT (sleeping ``delay`` s per calculation), after recording the call."""
    import json
    import os
    import time

    from ase.calculators.emt import EMT

    if count_file:
        line = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        with open(count_file, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")

    class SlowEMT(EMT):
        def calculate(self, *args, **kwargs):
            if trace_file:
                with open(trace_file, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps({"pid": os.getpid(), "t": time.time()}) + "\n")
            if delay:
                time.sleep(delay)
            super().calculate(*args, **kwargs)

    return SlowEMT()
