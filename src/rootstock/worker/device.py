"""Which device the model runs on, and whether the one asked for exists on this node.

Verification records the device the model really ran on, never just the one asked
for: a numpy model (EMT) ignores ``device="cuda"`` and runs on the CPU, and a torch
model may place itself elsewhere. The device is read from the model's parameters
(:mod:`rootstock.worker.dtype` finds the module), with torch looked up in
``sys.modules`` only: an env without torch costs nothing and reports ``cpu``.

When the client asks (``$ROOTSTOCK_CHECK_DEVICE``, set by verification), the worker
checks before ``setup()`` that the device it was given is visible on this node, so
``add --device cuda`` on a CPU node fails saying so instead of recording a pass on a
device that does not exist (or failing inside the model's own CUDA code).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

from rootstock.worker.dtype import find_module

# Device prefixes that torch runs through torch.cuda (ROCm builds included).
_CUDA_LIKE = ("cuda", "gpu", "rocm", "hip")
_XPU = ("xpu",)


class DeviceNotVisible(RuntimeError):
    """The requested accelerator is not visible on this node (raised before ``setup()``)."""


def detect_model_device(calc: Any) -> str | None:
    """The device the model's parameters live on (``cpu``, ``cuda:0``, ...).

    Without torch loaded by the model (EMT, numpy models): ``cpu``. With torch: the
    device of the first parameter (else buffer) of a ``torch.nn.Module`` reachable
    from the calculator, else the calculator's own ``device`` attribute; None when
    neither says.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return "cpu"
    module = find_module(calc, torch.nn.Module)
    if module is not None:
        found = first_tensor_device(module)
        if found is not None:
            return found
    declared = getattr(calc, "device", None)
    if isinstance(declared, str | torch.device):
        return str(declared)
    return None


def first_tensor_device(module: Any) -> str | None:
    """The device of ``module``'s first parameter, else its first buffer, as a string."""
    for tensors in (module.parameters(), module.buffers()):
        for tensor in tensors:
            return str(tensor.device)
    return None


def check_device_visible(device: str) -> None:
    """Raise :class:`DeviceNotVisible` when ``device`` names an accelerator this node
    does not show. torch is imported only when the env has it; an env without torch
    has no accelerator to run on."""
    base, _, index = device.strip().lower().partition(":")
    if base in _CUDA_LIKE:
        name, backend, variable, node = "CUDA", "cuda", "CUDA_VISIBLE_DEVICES", "a GPU node"
    elif base in _XPU:
        name, backend, variable, node = "XPU", "xpu", "ZE_AFFINITY_MASK", "an XPU node"
    else:
        return
    torch = _torch_if_installed()
    api = getattr(torch, backend, None) if torch is not None else None
    if torch is None:
        what, reason = f"no {name} device is", "torch is not installed in this env"
    elif api is None or not api.is_available():
        what, reason = f"no {name} device is", f"torch.{backend}.is_available() is False"
    elif index.isdigit() and int(index) >= int(api.device_count()):
        what = f"{name} device {index} is not"
        reason = f"torch.{backend}.device_count() is {int(api.device_count())}"
    else:
        return
    # Literal names, so the docs' scan of environment reads can check them.
    if variable == "CUDA_VISIBLE_DEVICES":
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    else:
        shown = os.environ.get("ZE_AFFINITY_MASK")
    setting = "unset" if shown is None else (shown or "''")
    raise DeviceNotVisible(
        f"{what} visible on this node ({reason}; {variable}={setting}): "
        f"run on {node}, or pass --device cpu"
    )


def _torch_if_installed() -> Any | None:
    """torch, imported, if this env has it; None (and nothing imported) otherwise."""
    if "torch" in sys.modules:
        return sys.modules["torch"]
    if importlib.util.find_spec("torch") is None:
        return None
    return importlib.import_module("torch")
