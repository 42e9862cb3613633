"""UMA (Meta FAIR Chemistry, package ``fairchem-core``) on Intel GPUs, for Aurora.

The Aurora variant of ``environments/uma.py``: the same checkpoint ids and the same
required ``task`` head, but torch comes from PyTorch's Intel XPU wheel index and
``setup()`` defaults to ``device="xpu"``. ``CLUSTERS = ["aurora"]`` makes this file
win over the universal ``uma`` env on Aurora, and only there.

Two adaptations, both unverified here (no Intel GPU in the test suite):

* fairchem's predict unit accepts only ``cpu`` and ``cuda`` device strings, so
  ``setup()`` teaches it ``xpu`` (see :func:`_accept_xpu`);
* inference runs in float64, because fairchem's float32 default is reported to
  drift from the FP64 reference on XPU.

The weights are gated (``facebook/UMA`` on Hugging Face): make ``HF_TOKEN``
readable, fetch on a login node with ``rootstock add uma-s-1p1 --no-verify
--kwarg task=omat --cluster aurora``, then verify on a compute node with one tile
pinned (``export ZE_AFFINITY_MASK=0``). The first forward pass compiles kernels,
so give verification time (``--verify-timeout 1800``).
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "fairchem-core>=2.24",
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

CHECKPOINTS = {
    "uma-s-1p1": "uma-s-1p1",
    "uma-m-1p1": "uma-m-1p1",
}

# What each checkpoint is: the same facts as environments/uma.py gives (docs/environments.md).
CHECKPOINT_INFO = {
    "uma-s-1p1": {
        "gated": "https://huggingface.co/facebook/UMA",
        "source": "https://huggingface.co/facebook/UMA (checkpoints/uma-s-1p1.pt)",
    },
    "uma-m-1p1": {
        "gated": "https://huggingface.co/facebook/UMA",
        "source": "https://huggingface.co/facebook/UMA (checkpoints/uma-m-1p1.pt)",
        "summary": "UMA medium: the most accurate UMA model, slower and larger than uma-s",
    },
}

VERIFY_KWARGS = {
    "uma-s-1p1": {"task": "omat"},
    "uma-m-1p1": {"task": "omat"},
}

TASKS = ("omat", "omol", "oc20", "odac", "omc")


def _upstream(checkpoint):
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {sorted(CHECKPOINTS)}")
    return CHECKPOINTS[checkpoint]


def _accept_xpu():
    """Let fairchem's MLIPPredictUnit take ``device="xpu"`` (idempotent).

    Upstream's device setup admits only cpu and cuda; for an xpu device the unit
    just needs the torch device, which is what the wrapper sets.
    """
    import torch
    from fairchem.core.units.mlip_unit import predict

    original = predict.MLIPPredictUnit._setup_device
    if getattr(original, "accepts_xpu", False):
        return

    def setup_device(self, device):
        if str(device).startswith("xpu"):
            self.device = torch.device(device)
            return None
        return original(self, device)

    setup_device.accepts_xpu = True
    predict.MLIPPredictUnit._setup_device = setup_device


def _float64_settings():
    import torch
    from fairchem.core.units.mlip_unit.api.inference import InferenceSettings

    return InferenceSettings(base_precision_dtype=torch.float64, tf32=False)


def download(checkpoint, **kw):
    """Fetch the checkpoint into the Hugging Face cache without building a model."""
    from fairchem.core.calculate.pretrained_mlip import pretrained_checkpoint_path_from_name

    return pretrained_checkpoint_path_from_name(_upstream(checkpoint))


def setup(checkpoint, device="xpu", task=None, **kw):
    """Return a FAIRChemCalculator for ``checkpoint`` with the head for ``task``."""
    name = _upstream(checkpoint)
    if task is None:
        raise ValueError(f"{checkpoint} needs task=<one of {', '.join(TASKS)}>")
    if task not in TASKS:
        raise ValueError(f"{checkpoint} has no task {task!r}; choose one of {', '.join(TASKS)}")
    from fairchem.core import FAIRChemCalculator, pretrained_mlip

    if str(device).startswith("xpu"):
        _accept_xpu()
    predictor = pretrained_mlip.get_predict_unit(
        name, device=device, inference_settings=_float64_settings()
    )
    return FAIRChemCalculator(predictor, task_name=task, **kw)
