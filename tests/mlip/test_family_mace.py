"""MACE through RootstockCalculator, proven offline with random weights.

The ``mace-torch`` wheel ships no weights and nothing here may reach a hub, so the
test builds a small randomly initialised ``ScaleShiftMACE`` (float64) in the env's
own Python, saves it as a whole-model ``.model`` file as ``mace_run_train`` does,
and loads it through ``mace:custom`` with ``weights=``. One calculator session
gives energy, forces and stress (compared with the same model run in-process in
the env, to 1e-6 relative) and then runs the physics consistency check.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rootstock.errors import WorkerError
from rootstock.ops.consistency import ConsistencyReport
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

# A two-layer MACE for copper with random weights. The atomic energy E0 and a
# 40-neighbour normaliser keep energy and forces at a realistic scale (|F| ~ 0.1
# eV/Å), so the finite differences of the consistency check sit far above the
# float64 noise. mace is imported before e3nn: importing mace is what lets torch
# unpickle e3nn's constants under torch's weights-only default.
BUILD_RANDOM_MACE = """
    import sys
    import numpy as np
    import torch
    from mace import modules
    from e3nn import o3

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    interaction = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    model = modules.ScaleShiftMACE(
        r_max=4.5,
        num_bessel=8,
        num_polynomial_cutoff=5,
        max_ell=2,
        interaction_cls=interaction,
        interaction_cls_first=interaction,
        num_interactions=2,
        num_elements=1,
        hidden_irreps=o3.Irreps("16x0e + 16x1o"),
        MLP_irreps=o3.Irreps("16x0e"),
        gate=torch.nn.functional.silu,
        atomic_energies=np.array([-3.75]),
        avg_num_neighbors=40.0,
        atomic_numbers=[29],
        correlation=2,
        radial_type="bessel",
        atomic_inter_scale=1.0,
        atomic_inter_shift=0.0,
    )
    torch.save(model, sys.argv[1])
"""


@pytest.fixture(scope="module")
def mace_root(family_env) -> Path:
    return family_env("mace")


@pytest.fixture(scope="module")
def built_mace(mace_root: Path, tmp_path_factory) -> tuple[Path, dict]:
    """A random ``ScaleShiftMACE`` saved as a ``.model`` file, then loaded back from it
    and run in-process (one run of the env's Python, once per module): (file, results)."""
    path = tmp_path_factory.mktemp("mace-weights") / "random-mace.model"
    build = (BUILD_RANDOM_MACE, [path])
    (reference,) = in_process_models(mace_root, "mace", [model_request(weights=path)], build=build)
    return path, reference


@pytest.fixture(scope="module")
def random_mace(built_mace: tuple[Path, dict]) -> Path:
    """The random ``ScaleShiftMACE``'s ``.model`` file."""
    return built_mace[0]


@pytest.fixture(scope="module")
def through_rootstock(
    mace_root: Path, random_mace: Path, same_threads
) -> tuple[dict, ConsistencyReport]:
    return session_with_check(mace_root, "mace:custom", weights=random_mace, dtype="float64")


def test_random_mace_through_rootstock_agrees_with_in_process(built_mace, through_rootstock):
    ours, _ = through_rootstock
    _, reference = built_mace
    figures = agreement(ours, reference)
    print(f"mace agreement (max relative difference): {figures}")
    # Random weights, but not a trivial model: E0 sets the energy, the layers the forces.
    assert abs(reference["energy"]) > 1.0
    assert np.abs(reference["forces"]).max() > 1e-2
    assert_agree(ours, reference, rtol=1e-6)


def test_random_mace_forces_and_stress_are_energy_derivatives(through_rootstock):
    _, report = through_rootstock
    print(f"mace consistency (float64): {ratios(report)}")
    assert report.dtype == "float64"
    assert report.checks["stress"].mode == "gradient"
    assert report.ok, f"{report.message} ({ratios(report)})"


def test_mace_custom_rejects_a_file_that_is_not_a_model(
    mace_root: Path, tmp_path: Path, same_threads
):
    garbage = tmp_path / "not-a-model.model"
    garbage.write_text("this is not a MACE model\n")
    with pytest.raises(WorkerError) as caught:
        through_calculator(mace_root, "mace:custom", weights=garbage)
    message = str(caught.value)
    # MACECalculator loads the file with torch.load, whose unpickler names the problem.
    assert "UnpicklingError" in message
    assert "WeightsNotLoaded" in message and str(garbage) in message  # the worker names it
