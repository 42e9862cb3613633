"""The worker's device report and its check of the requested device.

torch is not in the test venv. Its parameter path and its ``cuda``/``xpu`` APIs are
exercised with FAKE torch modules below (a stand-in registered in ``sys.modules``,
as the model's own ``import torch`` would leave the real one); the real path runs
in tests/mlip on CHGNet and SevenNet.
"""

from __future__ import annotations

import sys
import types

import pytest
from ase.calculators.emt import EMT

from rootstock.worker import device as worker_device
from rootstock.worker.device import DeviceNotVisible, check_device_visible, detect_model_device


class FakeTensor:
    def __init__(self, where: str) -> None:
        self.device = where


class FakeModule:
    """FAKE ``torch.nn.Module``: parameters and buffers on a given device."""

    def __init__(self, parameters: list[str], buffers: tuple[str, ...] = ()) -> None:
        self._parameters = [FakeTensor(d) for d in parameters]
        self._buffers = [FakeTensor(d) for d in buffers]

    def parameters(self):
        return iter(self._parameters)

    def buffers(self):
        return iter(self._buffers)


class FakeBackend:
    """FAKE ``torch.cuda`` / ``torch.xpu``."""

    def __init__(self, count: int) -> None:
        self.count = count

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count


def fake_torch(cuda: int = 0, xpu: int | None = None) -> types.ModuleType:
    """A FAKE torch module: ``nn.Module``, ``device`` and the accelerator backends."""
    torch = types.ModuleType("torch")
    torch.nn = types.SimpleNamespace(Module=FakeModule)
    torch.device = type("device", (), {})
    torch.cuda = FakeBackend(cuda)
    if xpu is not None:
        torch.xpu = FakeBackend(xpu)
    return torch


class TorchCalculator:
    """A calculator holding its network as ``model``, as CHGNet's and MACE's do."""

    def __init__(self, model, device=None) -> None:
        self.model = model
        if device is not None:
            self.device = device


def test_a_calculator_without_torch_runs_on_the_cpu():
    assert "torch" not in sys.modules
    assert detect_model_device(EMT()) == "cpu"


def test_a_torch_model_reports_where_its_parameters_are(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda=1))
    assert detect_model_device(TorchCalculator(FakeModule(["cuda:0", "cpu"]))) == "cuda:0"
    # No parameters: the buffers say; neither: the calculator's own ``device``; else unknown.
    assert detect_model_device(TorchCalculator(FakeModule([], ("xpu:1",)))) == "xpu:1"
    assert detect_model_device(TorchCalculator(FakeModule([]), device="cuda")) == "cuda"
    assert detect_model_device(EMT()) is None


def test_no_torch_means_no_accelerator(monkeypatch):
    monkeypatch.setattr(worker_device, "_torch_if_installed", lambda: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(DeviceNotVisible) as caught:
        check_device_visible("cuda")
    assert str(caught.value) == (
        "no CUDA device is visible on this node (torch is not installed in this env; "
        "CUDA_VISIBLE_DEVICES=unset): run on a GPU node, or pass --device cpu"
    )
    check_device_visible("cpu")
    check_device_visible("mps")  # not an accelerator torch.cuda or torch.xpu knows


def test_torch_without_the_device_asked_for(monkeypatch):
    monkeypatch.setattr(worker_device, "_torch_if_installed", lambda: fake_torch(cuda=0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceNotVisible, match=r"torch\.cuda\.is_available\(\) is False; "):
        check_device_visible("gpu")
    with pytest.raises(DeviceNotVisible) as caught:
        check_device_visible("cuda:1")
    assert "CUDA_VISIBLE_DEVICES='')" in str(caught.value)
    # An older torch has no torch.xpu at all.
    with pytest.raises(DeviceNotVisible, match=r"no XPU device .*torch\.xpu\.is_available"):
        check_device_visible("xpu")


def test_torch_with_the_device_asked_for(monkeypatch):
    monkeypatch.setattr(worker_device, "_torch_if_installed", lambda: fake_torch(cuda=2, xpu=1))
    check_device_visible("cuda")
    check_device_visible("cuda:1")
    check_device_visible("xpu:0")
    with pytest.raises(DeviceNotVisible) as caught:
        check_device_visible("cuda:2")
    assert str(caught.value).startswith(
        "CUDA device 2 is not visible on this node (torch.cuda.device_count() is 2; "
    )
