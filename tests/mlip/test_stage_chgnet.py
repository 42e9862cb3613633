"""A CHGNet worker started from a node-local stage computes what the shared env computes
(issue 30).

The family root's CHGNet build has no image (test builds pack none); a private copy of
it gets one, packed by the product's own :func:`~rootstock.install.images.make_image`
(real ``mksquashfs``) and recorded as ``install --image`` records it. Then real
``squashfuse`` mounts and ``unsquashfs`` extracts it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from ase.build import bulk

from rootstock import RootstockCalculator
from rootstock.install.images import make_image
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import record_env_build
from tests.integration.images import stage_dir  # noqa: F401
from tests.mlip.private_root import build_record, private_family_root

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture
def chgnet_image_root(mlip_root: Path, user_uv_cache: Path, tmp_path: Path) -> Path:
    root = private_family_root(mlip_root, tmp_path / "root", ("chgnet",), user_uv_cache)
    layout = InstallLayout(root, root)
    generation = layout.generation("chgnet")
    work = tmp_path / "work"
    work.mkdir()
    image = make_image(layout, generation, work)
    shutil.move(work / image.file, generation / image.file)
    record_path = generation / "rootstock-env.json"
    record = json.loads(record_path.read_text())
    record["image"] = image.to_record()
    record_path.write_text(json.dumps(record))
    record_env_build(layout, "chgnet", {**build_record(generation), "image": image.to_record()})
    return root


def _first(root: Path, stage: str) -> tuple[float, np.ndarray, str | None]:
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 1, 1))
    atoms.rattle(0.02, seed=21)
    with RootstockCalculator(
        "chgnet-0.3.0", root=root, device="cpu", shared=False, stage=stage
    ) as calc:
        atoms.calc = calc
        energy = float(atoms.get_potential_energy())
        forces = atoms.get_forces()
        return energy, forces, calc.staged


@pytest.mark.parametrize("mode", ["mount", "copy"])
def test_a_staged_chgnet_worker_computes_what_the_shared_env_computes(
    chgnet_image_root,
    stage_dir,  # noqa: F811
    mode,
):
    shared_energy, shared_forces, how = _first(chgnet_image_root, "off")
    assert how is None
    energy, forces, how = _first(chgnet_image_root, mode)
    assert how == mode
    assert energy == pytest.approx(shared_energy, abs=1e-6)
    np.testing.assert_allclose(forces, shared_forces, atol=1e-6)
    assert os.path.isdir(stage_dir / f".rootstock-stage-{os.getuid()}")
