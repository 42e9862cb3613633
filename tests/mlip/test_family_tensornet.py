"""TensorNet (MatGL) through ``tensornet:custom``, offline, on random weights.

The named TensorNet checkpoints come from the Hugging Face Hub, so nothing here
loads them. Instead a small randomly initialised TensorNet is built in the env's
own Python, wrapped in ``matgl.apps.pes.Potential`` and saved with
``Potential.save(dir)``; ``weights=<dir>`` loads it through ``setup_from_path``.
Energy, forces and stress through RootstockCalculator agree with the same model
in-process, and the physics check passes through the same calculator. The old
default (MatGL's stress in GPa) fails that check by a factor of about 160.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rootstock import RootstockCalculator
from rootstock.errors import WorkerError
from rootstock.ops.consistency import GPA_PER_EV_A3, ConsistencyReport
from tests.mlip.family import (
    agreement,
    assert_agree,
    in_process_models,
    model_request,
    session_with_check,
    structure,
)

pytestmark = [pytest.mark.mlip, pytest.mark.timeout(1200)]

ENV = "tensornet"
CUSTOM = "tensornet:custom"
# MatGL computes in float32 (matgl.float_th). The worker and the in-process run
# execute the same float32 graph on the same inputs and thread count, so they
# agree to a few float32 ulps (eps 1.2e-7); 1e-5 leaves room for reduction order.
FLOAT32_RTOL = 1e-5

# One interaction block of 16 units on Cu only: ~10k parameters, well under a second
# per call on two cores. The smooth Bessel basis keeps the energy smooth at the cutoff,
# so the finite differences of the physics check are meaningful. A random readout
# gives forces of ~5e-4 eV/Å on the rattled cell; data_std=100 scales the energy
# (and so forces and stress) to ~0.05 eV/Å and ~0.05 eV/Å³ (7 GPa), well above
# float32 noise, so the check cannot pass by comparing noise with noise.
BUILD_RANDOM_TENSORNET = """
    import sys
    import torch
    torch.manual_seed(0)
    from matgl.apps.pes import Potential
    from matgl.models import TensorNet
    model = TensorNet(element_types=("Cu",), units=16, nblocks=1, num_rbf=16, cutoff=4.0,
                      rbf_type="SphericalBessel", use_smooth=True, is_intensive=False,
                      use_warp=False)
    Potential(model, data_std=100.0).save(sys.argv[1])
"""


@pytest.fixture(scope="module")
def built_tensornet(family_env, tmp_path_factory) -> tuple[Path, Path, dict]:
    """A small random TensorNet saved by ``Potential.save``, then loaded back from the
    directory and run in-process (one run of the env's Python): (root, directory, results)."""
    root = family_env(ENV)
    saved = tmp_path_factory.mktemp("tensornet") / "random-tensornet"
    build = (BUILD_RANDOM_TENSORNET, [saved])
    (reference,) = in_process_models(root, ENV, [model_request(weights=saved)], build=build)
    assert sorted(p.name for p in saved.iterdir()) == ["model.json", "model.pt", "state.pt"]
    return root, saved, reference


@pytest.fixture(scope="module")
def random_tensornet(built_tensornet) -> tuple[Path, Path]:
    """(family root, directory) of a small random TensorNet saved by ``Potential.save``."""
    root, saved, _ = built_tensornet
    return root, saved


def one_session(
    root: Path, weights: Path, setup_kwargs: dict | None = None
) -> tuple[dict, ConsistencyReport]:
    """Energy, forces, stress and the float32 physics check, in one calculator session."""
    return session_with_check(
        root, CUSTOM, weights=weights, setup_kwargs=setup_kwargs, dtype="float32"
    )


def ratios(report: ConsistencyReport) -> dict[str, float | None]:
    return {name: check.ratio for name, check in report.checks.items()}


def test_random_tensornet_agrees_in_process_and_passes_the_physics_check(built_tensornet):
    root, saved, reference = built_tensornet
    ours, report = one_session(root, saved)

    assert np.abs(ours["forces"]).max() > 1e-2, "forces too small to test anything"
    assert np.abs(ours["stress"]).max() > 1e-3, "stress too small to test anything"
    figures = agreement(ours, reference)
    print(f"tensornet agreement (max rel diff): {figures}; check ratios: {ratios(report)}")
    assert_agree(ours, reference, rtol=FLOAT32_RTOL)
    assert report.dtype == "float32"
    assert report.ok, f"{report.message}; ratios {ratios(report)}"
    assert report.checks["stress"].mode == "gradient"


def test_stress_in_gpa_fails_the_physics_check(random_tensornet):
    """MatGL's default stress unit, as the env used to leave it, is caught."""
    root, saved = random_tensornet
    _, report = one_session(root, saved, setup_kwargs={"stress_unit": "GPa"})

    print(f"tensornet with stress_unit='GPa': check ratios {ratios(report)}")
    assert report.checks["forces"].ok, report.message
    stress = report.checks["stress"]
    assert stress.ok is False
    assert stress.ratio == pytest.approx(GPA_PER_EV_A3, rel=0.05)
    assert report.message is not None and report.message.startswith("stress is 160")
    assert "GPa vs eV/Å³" in report.message


def test_directory_matgl_cannot_load_is_a_worker_error(random_tensornet, tmp_path):
    root, _ = random_tensornet
    empty = tmp_path / "not-a-saved-potential"
    empty.mkdir()
    atoms = structure()
    calc = RootstockCalculator(root=root, checkpoint=CUSTOM, device="cpu", weights=empty)
    with pytest.raises(WorkerError) as caught, calc:
        atoms.calc = calc
        atoms.get_potential_energy()
    # MatGL's own words for a directory without model.json, model.pt and state.pt;
    # they name the directory, which setup_from_path passes as an absolute path.
    assert "No valid model found locally" in str(caught.value)
    assert str(empty) in str(caught.value)
