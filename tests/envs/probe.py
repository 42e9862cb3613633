"""Test env: records the worker's environment, then behaves as EMT.

``setup(..., dump=PATH)`` writes a JSON report of what the worker sees.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase"]
# ///

CHECKPOINTS = {"probe": "emt"}

REPORTED_VARS = (
    "HOME",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "PYTHONPATH",
    "PYTHONNOUSERSITE",
    "PYTHONPYCACHEPREFIX",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "CUDA_CACHE_PATH",
    "VIRTUAL_ENV",
)


def setup(checkpoint, device="cuda", dump=None, **kw):
    """Write the report to ``dump`` and return EMT."""
    import json
    import os
    import sys

    from ase.calculators.emt import EMT

    if dump:
        report = {
            "env": {k: os.environ.get(k) for k in REPORTED_VARS},
            "device": device,
            "kwargs": kw,
            "no_user_site": sys.flags.no_user_site,
            "isolated": sys.flags.isolated,
            "dont_write_bytecode": sys.flags.dont_write_bytecode,
            "pycache_prefix": sys.pycache_prefix,
        }
        with open(dump, "w") as fh:
            json.dump(report, fh)
    return EMT()
