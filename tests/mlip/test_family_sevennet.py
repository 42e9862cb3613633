"""SevenNet through RootstockCalculator: the shipped ``sevennet-0`` weights, and a
small random model through ``sevennet:custom``, proven offline.

The random model is built with sevenn's own ``build_E3_equivariant_model`` from a
small config in the env's Python and saved in the checkpoint format that sevenn
training writes (a dict with ``config`` and ``model_state_dict``). For each model,
one calculator session gives energy, forces and stress and then runs the physics
consistency check; the random model's results are compared with the same model run
in-process in the env (``sevennet-0``'s comparison is in test_mlip_calculator.py).

SevenNet runs in float32. The worker and the in-process run use the same code and
thread count, but the threaded kernels sum in no fixed order. The random model's
forces are small (|F| < 0.1 eV/Å) beside the per-atom energy terms they come from,
so a few float32 steps of those show up relatively large: measured 4e-7 of the
largest force on one run and 2.6e-5 on another (the energy: 3.4e-7). The bound of
1e-4 relative leaves room for that while catching any real drift (a wrong cutoff,
dtype or weight is off by percent).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rootstock.errors import WorkerError
from tests.mlip.family import (
    agreement,
    assert_agree,
    in_process_models,
    model_request,
    ratios,
    session_with_check,
    through_calculator,
)

pytestmark = [pytest.mark.mlip, pytest.mark.timeout(1200)]

FLOAT32_RTOL = 1e-4

# A two-layer, 16-channel, lmax 1 SevenNet for copper with random weights. A
# per-atom shift (-3.75 eV) and scale (4) keep energy and forces at a realistic
# scale (|F| ~ 0.1 eV/Å), so the finite differences of the consistency check sit
# well above the float32 noise of the energy.
BUILD_RANDOM_SEVENNET = """
    import copy, sys
    import torch
    import sevenn
    import sevenn._keys as KEY
    from sevenn._const import DEFAULT_E3_EQUIVARIANT_MODEL_CONFIG
    from sevenn.model_build import build_E3_equivariant_model

    torch.manual_seed(0)
    config = copy.deepcopy(DEFAULT_E3_EQUIVARIANT_MODEL_CONFIG)
    config.update({
        KEY.CUTOFF: 4.5,
        KEY.NODE_FEATURE_MULTIPLICITY: 16,
        KEY.LMAX: 1,
        KEY.NUM_CONVOLUTION: 2,
        KEY.CONVOLUTION_WEIGHT_NN_HIDDEN_NEURONS: [16, 16],
        KEY.CONV_DENOMINATOR: 40.0,
        KEY.CHEMICAL_SPECIES: ["Cu"],
        KEY.NUM_SPECIES: 1,
        KEY.TYPE_MAP: {29: 0},
        KEY.SHIFT: -3.75,
        KEY.SCALE: 4.0,
        "version": sevenn.__version__,
    })
    model = build_E3_equivariant_model(copy.deepcopy(config))
    torch.save({"config": config, "model_state_dict": model.state_dict()}, sys.argv[1])
"""


@pytest.fixture(scope="module")
def sevennet_root(family_env) -> Path:
    return family_env("sevennet")


@pytest.fixture(scope="module")
def built_sevennet(sevennet_root: Path, tmp_path_factory) -> tuple[Path, dict]:
    """A random SevenNet saved as a sevenn checkpoint, then loaded back from it and run
    in-process (one run of the env's Python, once per module): (file, results)."""
    path = tmp_path_factory.mktemp("sevennet-weights") / "random-sevennet.pth"
    build = (BUILD_RANDOM_SEVENNET, [path])
    models = [model_request(weights=path)]
    (reference,) = in_process_models(sevennet_root, "sevennet", models, build=build)
    return path, reference


@pytest.fixture(scope="module")
def random_sevennet(built_sevennet: tuple[Path, dict]) -> Path:
    """The random SevenNet's checkpoint file."""
    return built_sevennet[0]


@pytest.fixture(scope="module")
def random_through_rootstock(sevennet_root: Path, random_sevennet: Path, same_threads):
    return session_with_check(
        sevennet_root, "sevennet:custom", weights=random_sevennet, dtype="float32"
    )


@pytest.fixture(scope="module")
def shipped_through_rootstock(sevennet_root: Path, same_threads):
    return session_with_check(sevennet_root, "sevennet-0", dtype="float32")


def test_random_sevennet_through_rootstock_agrees_with_in_process(
    built_sevennet, random_through_rootstock
):
    ours, _ = random_through_rootstock
    _, reference = built_sevennet
    figures = agreement(ours, reference)
    print(f"sevennet:custom (random) agreement (max relative difference): {figures}")
    # Random weights, but not a trivial model: the shift sets the energy, the layers the forces.
    assert abs(reference["energy"]) > 1.0
    assert np.abs(reference["forces"]).max() > 1e-2
    assert_agree(ours, reference, rtol=FLOAT32_RTOL)


def test_random_sevennet_forces_and_stress_are_energy_derivatives(random_through_rootstock):
    _, report = random_through_rootstock
    print(f"sevennet:custom (random) consistency (float32): {ratios(report)}")
    assert report.dtype == "float32"
    assert report.checks["stress"].mode == "gradient"
    assert report.ok, f"{report.message} ({ratios(report)})"


def test_sevennet_0_forces_and_stress_are_energy_derivatives(shipped_through_rootstock):
    _, report = shipped_through_rootstock
    print(f"sevennet-0 consistency (float32): {ratios(report)}")
    assert report.dtype == "float32"
    assert report.ok, f"{report.message} ({ratios(report)})"


def test_sevennet_custom_rejects_a_file_that_is_not_a_checkpoint(
    sevennet_root: Path, tmp_path: Path, same_threads
):
    garbage = tmp_path / "not-a-checkpoint.pth"
    garbage.write_text("this is not a SevenNet checkpoint\n")
    with pytest.raises(WorkerError) as caught:
        through_calculator(sevennet_root, "sevennet:custom", weights=garbage)
    message = str(caught.value)
    # sevenn loads the checkpoint with torch.load, whose unpickler names the problem.
    assert "UnpicklingError" in message
    assert "WeightsNotLoaded" in message and str(garbage) in message  # the worker names it


def test_sevennet_custom_rejects_a_directory(sevennet_root: Path, tmp_path: Path, same_threads):
    """Not a file: setup_from_path says so, rather than sevenn looking the name up
    among its pretrained models."""
    with pytest.raises(WorkerError) as caught:
        through_calculator(sevennet_root, "sevennet:custom", weights=tmp_path)
    assert "is not a file" in str(caught.value)
