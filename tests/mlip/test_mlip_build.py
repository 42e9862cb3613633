"""Real builds of the CHGNet and SevenNet envs with the machine's CPU torch wheel."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import local_torch_wheel

pytestmark = [pytest.mark.mlip, pytest.mark.timeout(1800)]


@pytest.mark.parametrize("name", ["chgnet", "sevennet"])
def test_mlip_env_builds_on_local_cpu_torch(mlip_root: Path, name: str):
    meta = json.loads((mlip_root / "envs" / name / "rootstock-env.json").read_text())
    lock = (mlip_root / "environments" / f"{name}.py.lock").read_text()
    wheel = local_torch_wheel()
    if wheel is not None:
        local_version = wheel.name.split("-")[1]
        assert meta["versions"]["torch"] == local_version
        assert f'version = "{local_version}"' in lock
        cuda_packages = re.findall(r'name = "((?:nvidia-(?:cu|nccl|nvjitlink)|cuda-)[^"]*)"', lock)
        assert not cuda_packages, "the CUDA build of torch must never be resolved"
    else:
        assert meta["versions"]["torch"], "PyPI's torch is the fallback"
    # The sample env file itself stays production-shaped: plain torch, no CPU pin.
    source = (mlip_root / "envs" / name / "env_source.py").read_text()
    assert "+cpu" not in source and "find-links" not in source


def test_chgnet_weights_ship_in_the_wheel(mlip_root: Path):
    probe = (
        "import pathlib, chgnet; p = pathlib.Path(chgnet.__file__).parent / 'pretrained';"
        " print(sorted(x.name for x in p.iterdir() if x.is_dir()))"
    )
    out = subprocess.run(
        [mlip_root / "envs" / "chgnet" / "bin" / "python", "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert {"0.2.0", "0.3.0", "r2scan"} <= set(json.loads(out.replace("'", '"')))
