"""MACE foundation models on Intel GPUs (Aurora's Data Center GPU Max, "PVC").

The Aurora variant of ``environments/mace.py``: the same checkpoint ids, but torch
comes from PyTorch's Intel XPU wheel index and ``setup()`` defaults to
``device="xpu"``. ``CLUSTERS = ["aurora"]`` makes this file win over the universal
``mace`` env on Aurora, and only there. MACE's plain e3nn/torch code path runs on
XPU; cuEquivariance acceleration is CUDA-only and is not installed.

Not built or run by the test suite (the XPU index and the hardware are needed).
Download on a login node (``rootstock add mace-mp-0-medium --no-verify --cluster
aurora``), then verify on a compute node with one tile pinned
(``export ZE_AFFINITY_MASK=0``; the worker inherits it) and ``--device xpu``.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "mace-torch>=0.3.10",
#     # Recent XPU wheels: older ones are reported to have much slower FP64
#     # kernels on PVC (unverified here).
#     "torch>=2.13",
#     # A runtime dependency of torch's XPU wheels that only the XPU index
#     # serves; the index is explicit, so it must be a direct dependency
#     # routed there by [tool.uv.sources] below.
#     "triton-xpu",
#     "ase>=3.23",
#     "numpy",
# ]
#
# [tool.uv.sources]
# torch = { index = "pytorch-xpu" }
# triton-xpu = { index = "pytorch-xpu" }
#
# [[tool.uv.index]]
# name = "pytorch-xpu"
# url = "https://download.pytorch.org/whl/xpu"
# explicit = true
# ///

CLUSTERS = ["aurora"]

# id -> the name mace.calculators.mace_mp() takes (the ids of environments/mace.py)
CHECKPOINTS = {
    "mace-mp-0-small": "small",
    "mace-mp-0-medium": "medium",
    "mace-mp-0-large": "large",
    "mace-mpa-0-medium": "medium-mpa-0",
    "mace-omat-0-medium": "medium-omat-0",
    "mace:custom": None,
}

# What each checkpoint is: the same facts as environments/mace.py gives (docs/environments.md).
CHECKPOINT_INFO = {
    "mace-mp-0-small": {
        "licence": "MIT",
        "gated": None,
        "source": "https://github.com/ACEsuit/mace-mp/releases/download/mace_mp_0/2023-12-10-mace-128-L0_energy_epoch-249.model",
        "citation": "arXiv:2401.00096",
        "training_data": "MPtrj",
        "summary": "MACE-MP-0 small: universal potential for 89 elements, PBE+U",
    },
    "mace-mp-0-medium": {
        "licence": "MIT",
        "gated": None,
        "source": "https://github.com/ACEsuit/mace-mp/releases/download/mace_mp_0/2023-12-03-mace-128-L1_epoch-199.model",
        "citation": "arXiv:2401.00096",
        "training_data": "MPtrj",
        "summary": "MACE-MP-0 medium: universal potential for 89 elements, PBE+U",
    },
    "mace-mp-0-large": {
        "licence": "MIT",
        "gated": None,
        "source": "https://github.com/ACEsuit/mace-mp/releases/download/mace_mp_0/MACE_MPtrj_2022.9.model",
        "citation": "arXiv:2401.00096",
        "training_data": "MPtrj",
        "summary": "MACE-MP-0 large: universal potential for 89 elements, PBE+U",
    },
    "mace-mpa-0-medium": {
        "licence": "MIT",
        "gated": None,
        "source": "https://github.com/ACEsuit/mace-mp/releases/download/mace_mpa_0/mace-mpa-0-medium.model",
        "training_data": "MPtrj + sAlex",
        "summary": "MACE-MPA-0: improved accuracy and high-pressure stability over MACE-MP-0",
    },
    "mace-omat-0-medium": {
        "licence": "custom:https://github.com/gabor1/ASL",
        "gated": None,
        "source": "https://github.com/ACEsuit/mace-mp/releases/download/mace_omat_0/mace-omat-0-medium.model",
        "training_data": "OMAT",
        "summary": "MACE-OMAT-0: 89 elements, PBE+U; Academic Software License, no commercial use",
    },
    "mace:custom": {
        "summary": "a user's own MACE model (.model), loaded through setup_from_path()"
    },
}


def _upstream(checkpoint):
    if checkpoint not in CHECKPOINTS or CHECKPOINTS[checkpoint] is None:
        choices = sorted(c for c, name in CHECKPOINTS.items() if name is not None)
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {choices}")
    return CHECKPOINTS[checkpoint]


def download(checkpoint, **kw):
    """Fetch the weights into the cache without building a model; return their path."""
    from mace.calculators.foundations_models import download_mace_mp_checkpoint

    return download_mace_mp_checkpoint(_upstream(checkpoint))


def setup(checkpoint, device="xpu", default_dtype="float64", **kw):
    """Return a MACECalculator for a foundation checkpoint, on an Intel GPU by default.

    ``default_dtype`` defaults to float64 (as in the universal env); pass
    ``float32`` for faster molecular dynamics.
    """
    from mace.calculators import mace_mp

    return mace_mp(model=_upstream(checkpoint), device=device, default_dtype=default_dtype, **kw)


def setup_from_path(path, device="xpu", default_dtype="float64", **kw):
    """Return a MACECalculator for a user's own ``.model`` file (e.g. a fine-tune)."""
    from mace.calculators import MACECalculator

    # A one-item list, not a str: MACECalculator globs a str, so a name holding "[" or
    # "*" would load some other file, or none.
    paths = [str(path)]
    return MACECalculator(model_paths=paths, device=device, default_dtype=default_dtype, **kw)
