"""Test env: each checkpoint's download() or setup() fails the way a real one does.

``add`` must name the cause and the fix in one line each (tests/integration/
test_add_failures.py): no network, gated weights (declared gated in CHECKPOINT_INFO
or not), a full disk, the out-of-memory killer, a download past its time limit, a
bug in the env file, and a ``setup()`` that needs a keyword argument no
``VERIFY_KWARGS`` entry gives it.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "ase>=3.23",
#     "numpy>=1.24",
# ]
# ///

CHECKPOINTS = {
    "offline": "no network on this node",
    "gated": "HTTP 403 from the hub",
    "gated-declared": "HTTP 403 from the hub, for weights CHECKPOINT_INFO says are gated",
    "disk-full": "ENOSPC while writing the weights",
    "oom": "SIGKILL, as the out-of-memory killer sends it",
    "slow": "a download that never ends",
    "buggy": "a bug in download()",
    "needs-head": "setup() needs head=, which VERIFY_KWARGS does not give",
}

# Only gated-declared says where access is requested: with no token its add stops
# before the download, and a 403 during the download is said in the same one line.
CHECKPOINT_INFO = {
    "gated-declared": {"gated": "https://huggingface.co/example-org/gated-model"},
}

WEIGHTS_URL = "https://huggingface.co/example-org/gated-model/resolve/main/model.pt"


def download(checkpoint, **kw):
    """Fail as ``checkpoint`` says; ``needs-head`` has nothing to fetch."""
    import errno
    import os
    import signal
    import socket
    import time
    import urllib.error

    if checkpoint == "offline":
        reason = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        raise urllib.error.URLError(reason)
    if checkpoint in ("gated", "gated-declared"):
        raise urllib.error.HTTPError(WEIGHTS_URL, 403, "Forbidden", None, None)
    if checkpoint == "disk-full":
        target = os.path.join(os.environ["XDG_CACHE_HOME"], "model.pt")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target)
    if checkpoint == "oom":
        os.kill(os.getpid(), signal.SIGKILL)
    if checkpoint == "slow":
        time.sleep(600)
    if checkpoint == "buggy":
        return {"weights": "model.pt"}["model"]
    return None


def setup(checkpoint, device="cuda", *, head, **kw):
    """EMT, for a caller that names the head; Python's TypeError for one that does not."""
    from ase.calculators.emt import EMT

    return EMT()
