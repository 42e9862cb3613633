"""Test env: EMT whose download() fetches a small weight file into the cache root.

The weight-integrity tests (tests/integration/test_weight_integrity.py) flip, grow or
touch that file after ``rootstock add`` hashed it. ``setup()`` only checks that the
file is there and not empty: its bytes never change the physics, so a changed file
that verification does not catch still verifies.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase", "numpy"]
# ///

CHECKPOINTS = {"weights-emt": "emt-with-a-fetched-weight-file"}

SIZE = 64 * 1024


def weights_path(checkpoint):
    """Where the fetched file lives: inside the worker's cache root."""
    import os

    return os.path.join(os.environ["XDG_CACHE_HOME"], "weights-emt", checkpoint + ".bin")


def download(checkpoint, **kw):
    """Write SIZE deterministic bytes (a stand-in for a downloaded model file)."""
    import hashlib
    import os

    path = weights_path(checkpoint)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    block = hashlib.sha256(checkpoint.encode()).digest()
    with open(path + ".part", "wb") as fh:
        fh.write((block * (SIZE // len(block) + 1))[:SIZE])
    os.replace(path + ".part", path)
    return [path]


def setup(checkpoint, device="cuda", **kw):
    """ASE's EMT, once the fetched file is found."""
    import os

    from ase.calculators.emt import EMT

    if os.path.getsize(weights_path(checkpoint)) == 0:
        raise RuntimeError("the weight file is empty")
    return EMT()
