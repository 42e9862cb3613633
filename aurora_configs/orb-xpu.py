"""Orb-v3 (Orbital Materials, package ``orb-models``) on Intel GPUs, for Aurora.

The Aurora variant of ``environments/orb.py``: the same checkpoint ids, but torch
comes from PyTorch's Intel XPU wheel index and ``setup()`` defaults to
``device="xpu"``. ``CLUSTERS = ["aurora"]`` makes this file win over the universal
``orb`` env on Aurora, and only there. Orb is plain PyTorch (no custom CUDA
kernels), which is why it is a candidate for XPU at all; running it there is
unverified here.

Download on a login node (``rootstock add orb-v3-conservative-inf-omat --no-verify
--cluster aurora``), then verify on a compute node with one tile pinned
(``export ZE_AFFINITY_MASK=0``).
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "orb-models>=0.5,<0.6",
#     "torch>=2.13",
#     # Only the XPU index serves torch's triton-xpu runtime; see mace-xpu.py.
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

# id -> key of orb_models.forcefield.pretrained.ORB_PRETRAINED_MODELS
CHECKPOINTS = {
    "orb-v3-conservative-inf-omat": "orb-v3-conservative-inf-omat",
    "orb-v3-conservative-20-omat": "orb-v3-conservative-20-omat",
    "orb-v3-direct-20-omat": "orb-v3-direct-20-omat",
    "orb-v3-conservative-inf-mpa": "orb-v3-conservative-inf-mpa",
}

# What each checkpoint is: the same facts as environments/orb.py gives (docs/environments.md).
CHECKPOINT_INFO = {
    "orb-v3-conservative-inf-omat": {
        "licence": "Apache-2.0",
        "gated": None,
        "source": "https://orbitalmaterials-public-models.s3.us-west-1.amazonaws.com/forcefields/orb-v3/orb-v3-conservative-inf-omat-20250404.ckpt",
        "citation": "arXiv:2504.06231",
        "training_data": "OMAT",
        "summary": "Orb-v3, conservative, every neighbour within 6 Å",
    },
    "orb-v3-conservative-20-omat": {
        "licence": "Apache-2.0",
        "gated": None,
        "source": "https://orbitalmaterials-public-models.s3.us-west-1.amazonaws.com/forcefields/orb-v3/orb-v3-conservative-20-omat-20250404.ckpt",
        "citation": "arXiv:2504.06231",
        "training_data": "OMAT",
        "summary": "Orb-v3, conservative, at most 20 neighbours",
    },
    "orb-v3-direct-20-omat": {
        "licence": "Apache-2.0",
        "gated": None,
        "source": "https://orbitalmaterials-public-models.s3.us-west-1.amazonaws.com/forcefields/orb-v3/orb-v3-direct-20-omat-20250404.ckpt",
        "citation": "arXiv:2504.06231",
        "training_data": "OMAT",
        "summary": "Orb-v3, direct forces and stress, at most 20 neighbours",
    },
    "orb-v3-conservative-inf-mpa": {
        "licence": "Apache-2.0",
        "gated": None,
        "source": "https://orbitalmaterials-public-models.s3.us-west-1.amazonaws.com/forcefields/orb-v3/orb-v3-conservative-inf-mpa-20250404.ckpt",
        "citation": "arXiv:2504.06231",
        "training_data": "MPTraj + Alexandria",
        "summary": "Orb-v3, conservative, every neighbour within 6 Å",
    },
}


def _loader(checkpoint):
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {sorted(CHECKPOINTS)}")
    from orb_models.forcefield import pretrained

    return pretrained.ORB_PRETRAINED_MODELS[CHECKPOINTS[checkpoint]]


def download(checkpoint, **kw):
    """Fetch the weights into cached_path's cache without building a model."""
    import inspect

    from cached_path import cached_path

    # Each loader's weights URL is the default of its weights_path parameter;
    # cached_path is what the loader itself would call.
    url = inspect.signature(_loader(checkpoint)).parameters["weights_path"].default
    return str(cached_path(url))


def setup(checkpoint, device="xpu", precision="float32-high", compile=False, **kw):
    """Return an ORBCalculator; ``precision`` may be float32-high, float32-highest or float64.

    ``compile`` (torch.compile) is off by default here: compiling through Triton for
    XPU is untested, and eager mode needs no compiler on the compute node.
    """
    from orb_models.forcefield.calculator import ORBCalculator

    model = _loader(checkpoint)(device=device, precision=precision, compile=bool(compile))
    return ORBCalculator(model, device=device, **kw)
