"""ORB v3 (orb-models 0.5.x) through ``orb:custom``, offline, on random weights.

The named ORB checkpoints download from Orbital Materials' bucket, so nothing here
loads them. Instead a randomly initialised conservative and a direct orb-v3 model
are built in the env's own Python and saved as state dicts; ``weights=<file>`` with
``setup_kwargs={"architecture": ...}`` loads them through ``setup_from_path``.

* Energy, forces and stress through RootstockCalculator agree with the same model
  in-process.
* The physics check, through the same calculator: the conservative model's forces
  and stress are the energy's gradients; a random *direct* model's forces are not
  (its force head is unrelated to its energy head), so even the loose bound fails,
  naming forces. A trained direct model is expected to pass the loose bound.
* The same conservative weights under the 20-neighbour cap fail the gradient check
  on the verification reference, which is why ``VERIFY_CHECKS`` declares
  ``orb-v3-conservative-20-omat``'s energy non-smooth.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ase import Atoms

from rootstock import RootstockCalculator
from rootstock.errors import WorkerError
from rootstock.ops.consistency import ConsistencyReport, check_consistency
from rootstock.ops.verify import default_reference
from tests.mlip.family import (
    agreement,
    assert_agree,
    in_process_models,
    model_request,
    run_in_env,
    small_structure,
)

pytestmark = [pytest.mark.mlip, pytest.mark.timeout(1200)]

ENV = "orb"
CUSTOM = "orb:custom"
CONSERVATIVE = "orb-v3-conservative-inf-omat"
CONSERVATIVE_20 = "orb-v3-conservative-20-omat"
DIRECT = "orb-v3-direct-20-omat"
DIRECT_MODES = {"forces": "direct", "stress": "direct"}
NON_SMOOTH = {"energy": "non-smooth"}
# The env's default precision is float32-high, which on CPU is plain float32 (it
# only allows TF32 matmuls on a GPU). ORB's conservative forces and stress come from
# autograd, whose threaded scatter-adds sum in no fixed order: two identical calls in
# one process differed by up to 7e-6 of the largest force (8e-6 across thread
# counts), the stress by 1e-6. 5e-5 is ~6x that and far below a model or unit
# difference. The energy does not go through autograd and stays within float32 ulps.
FLOAT32_RTOL = 5e-5
ENERGY_RTOL = 1e-6

# Full-size orb-v3 (~25.5M parameters, ~100 MB saved): the architecture functions'
# size knobs (latent_dim, ...) change the state dict's shapes, so a smaller model
# would not load into any named architecture. One energy+forces+stress call on a
# 32-atom cell takes ~1-3.5 s (conservative) or ~1.3 s (direct) on two cores, so every
# structure here has 8 atoms (small_structure(), and the verification reference).
# A random energy head varies by a few meV over the cell (forces ~0.05 eV/Å,
# on a -170 eV total of fixed per-element reference energies), so the finite
# differences would compare float32 noise. The energy normaliser's variance is a
# buffer that training fits to data; times 1e4 (std x100) gives forces of a few
# eV/Å, as a trained model's on a rattled cell.
BUILD_RANDOM_ORB = """
    import sys
    import torch
    torch.manual_seed(0)
    from orb_models.forcefield import pretrained
    for kind, path in zip(("conservative", "direct"), sys.argv[1:], strict=True):
        build = getattr(pretrained, f"orb_v3_{kind}_architecture")
        state = build(device="cpu").state_dict()
        state["heads.energy.normalizer.bn.running_var"] *= 1e4
        torch.save(state, path)
"""


ARCHITECTURES = {"conservative": CONSERVATIVE, "direct": DIRECT}


@pytest.fixture(scope="module")
def built_orb(family_env, tmp_path_factory) -> dict[str, Any]:
    """Random orb-v3 state dicts, built and then each run in-process on
    :func:`small_structure`, in one run of the env's Python: ``root``, ``files`` and
    ``in_process`` (by kind: "conservative", "direct")."""
    root = family_env(ENV)
    folder = tmp_path_factory.mktemp("orb")
    files = {kind: folder / f"random-orb-v3-{kind}.pt" for kind in ARCHITECTURES}
    requests = [
        model_request(weights=files[kind], kwargs={"architecture": architecture})
        for kind, architecture in ARCHITECTURES.items()
    ]
    build = (BUILD_RANDOM_ORB, [files["conservative"], files["direct"]])
    results = in_process_models(root, ENV, requests, atoms=small_structure(), build=build)
    in_process = dict(zip(ARCHITECTURES, results, strict=True))
    return {"root": root, "files": files, "in_process": in_process}


@pytest.fixture(scope="module")
def random_orb(built_orb) -> tuple[Path, dict[str, Path]]:
    """(family root, {"conservative": file, "direct": file}) of random orb-v3 state dicts."""
    return built_orb["root"], built_orb["files"]


@pytest.fixture(scope="module")
def in_process_results(built_orb) -> dict[str, dict[str, Any]]:
    """Both random models run in the env's own Python on :func:`small_structure`."""
    return built_orb["in_process"]


def reference_atoms() -> Atoms:
    """The 8-atom structure ``rootstock add`` verifies on."""
    spec = default_reference()
    return Atoms(
        symbols=spec["symbols"], positions=spec["positions"], cell=spec["cell"], pbc=spec["pbc"]
    )


@contextmanager
def orb_session(root: Path, weights: Path, architecture: str) -> Iterator[RootstockCalculator]:
    """One RootstockCalculator on ``weights`` via ``orb:custom``."""
    with RootstockCalculator(
        root=root,
        checkpoint=CUSTOM,
        device="cpu",
        weights=weights,
        setup_kwargs={"architecture": architecture},
    ) as calc:
        yield calc


def compute(calc: RootstockCalculator, atoms: Atoms) -> dict[str, Any]:
    """Energy, forces and stress of ``atoms`` through ``calc``."""
    atoms.calc = calc
    return {
        "energy": atoms.get_potential_energy(),
        "forces": atoms.get_forces(),
        "stress": atoms.get_stress(),
    }


def ratios(report: ConsistencyReport) -> dict[str, tuple[float | None, float | None]]:
    """(ratio, cosine) per quantity, for the printed figures."""
    return {name: (check.ratio, check.cosine) for name, check in report.checks.items()}


@pytest.fixture(scope="module")
def conservative(random_orb) -> dict[str, Any]:
    """The random conservative model under the 120 cap: results on :func:`small_structure`,
    and the float32 physics check on it and on the verification reference."""
    root, files = random_orb
    with orb_session(root, files["conservative"], CONSERVATIVE) as calc:
        atoms = small_structure()
        return {
            "results": compute(calc, atoms),
            "cell": check_consistency(atoms, calc, dtype="float32"),
            "reference": check_consistency(reference_atoms(), calc, dtype="float32"),
        }


@pytest.fixture(scope="module")
def direct(random_orb) -> dict[str, Any]:
    """The random direct model: results and the physics check on :func:`small_structure`."""
    root, files = random_orb
    with orb_session(root, files["direct"], DIRECT) as calc:
        atoms = small_structure()
        return {
            "results": compute(calc, atoms),
            "cell": check_consistency(atoms, calc, dtype="float32", modes=DIRECT_MODES),
        }


def test_random_conservative_orb_agrees_in_process_and_passes_the_physics_check(
    conservative, in_process_results
):
    ours = conservative["results"]
    reference = in_process_results["conservative"]

    assert np.abs(ours["forces"]).max() > 0.5, "forces too small to test anything"
    assert np.abs(ours["stress"]).max() > 1e-2, "stress too small to test anything"
    figures = agreement(ours, reference)
    print(
        f"orb conservative agreement (max rel diff): {figures}; check (ratio, cosine): "
        f"cell {ratios(conservative['cell'])}, reference {ratios(conservative['reference'])}"
    )
    assert_agree(ours, reference, rtol=FLOAT32_RTOL)
    assert ours["energy"] == pytest.approx(reference["energy"], rel=ENERGY_RTOL)
    for report in (conservative["cell"], conservative["reference"]):
        assert report.dtype == "float32"
        assert report.ok, f"{report.message}; {ratios(report)}"
        assert report.checks["forces"].mode == "gradient"
        assert report.checks["stress"].mode == "gradient"


def test_random_direct_orb_agrees_in_process_and_its_forces_are_not_the_gradient(
    direct, in_process_results
):
    ours = direct["results"]
    reference = in_process_results["direct"]

    figures = agreement(ours, reference)
    report = direct["cell"]
    loose = {c.quantity: (c.ratio, c.cosine, c.norm_ratio) for c in report.checks.values()}
    print(f"orb direct agreement (max rel diff): {figures}; (ratio, cosine, norm ratio): {loose}")
    assert_agree(ours, reference, rtol=FLOAT32_RTOL)
    assert ours["energy"] == pytest.approx(reference["energy"], rel=ENERGY_RTOL)
    assert report.checks["forces"].mode == "direct"
    assert report.checks["stress"].mode == "direct"
    assert report.checks["forces"].tol == {"min_cosine": 0.9, "norm_ratio": [0.5, 2.0]}
    # Random force and energy heads are unrelated: no loose bound can hold.
    assert report.checks["forces"].ok is False
    assert report.message is not None and report.message.startswith("forces are")


def test_the_20_neighbour_cap_makes_the_energy_non_smooth(random_orb, conservative):
    """The same weights fail the gradient check under the 20 cap: the reason
    ``VERIFY_CHECKS`` declares ``orb-v3-conservative-20-omat`` non-smooth."""
    root, files = random_orb
    with orb_session(root, files["conservative"], CONSERVATIVE_20) as calc:
        capped = check_consistency(reference_atoms(), calc, dtype="float32")
        loose = check_consistency(reference_atoms(), calc, dtype="float32", modes=NON_SMOOTH)
    uncapped = conservative["reference"]

    print(
        f"orb on the reference, (ratio, cosine): 120 cap {ratios(uncapped)}, 20 cap "
        f"{ratios(capped)}; 20 cap under the loose bound: ok={loose.ok} ({loose.message})"
    )
    assert uncapped.ok, uncapped.message
    assert capped.checks["forces"].ok is False
    assert abs(capped.checks["forces"].ratio - 1) > 0.5


def worker_error(root: Path, weights: Path, setup_kwargs: dict[str, Any]) -> str:
    """The WorkerError a session with these weights and kwargs ends in."""
    atoms = small_structure()
    with (
        pytest.raises(WorkerError) as caught,
        RootstockCalculator(
            root=root, checkpoint=CUSTOM, device="cpu", weights=weights, setup_kwargs=setup_kwargs
        ) as calc,
    ):
        atoms.calc = calc
        atoms.get_potential_energy()
    return str(caught.value)


def test_custom_needs_a_known_architecture(random_orb):
    root, files = random_orb
    for kwargs, given in (({}, "no architecture"), ({"architecture": "orb-v9"}, "'orb-v9'")):
        message = worker_error(root, files["conservative"], kwargs)
        assert given in message
        assert "choose one of" in message and CONSERVATIVE in message and DIRECT in message


def test_direct_weights_under_a_conservative_architecture_are_refused(random_orb):
    root, files = random_orb
    message = worker_error(root, files["direct"], {"architecture": CONSERVATIVE})
    assert f"does not fit architecture '{CONSERVATIVE}'" in message
    # ORB's own words: the conservative model's gradient normaliser is not in the file.
    assert "Missing key in state_dict: grad_forces_normalizer" in message


def test_weights_orb_cannot_load_are_a_worker_error(random_orb, tmp_path):
    """A truncated download: the head of a real state dict, cut off."""
    root, files = random_orb
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(files["conservative"].read_bytes()[:4096])
    message = worker_error(root, truncated, {"architecture": CONSERVATIVE})
    assert "as a torch state dict" in message
    # torch.load's own words for a zip archive cut short.
    assert "PytorchStreamReader failed reading zip archive" in message


# A direct orb-v3 without its stress head, loaded as orb-v3-direct-20-omat (which has
# one): ORB's own strict load would accept it and leave that head random.
LOAD_WITHOUT_STRESS_HEAD = """
    import importlib.util, sys
    import torch
    from orb_models.forcefield import pretrained
    torch.save(pretrained.orb_v3_direct_architecture(has_stress=False).state_dict(), sys.argv[2])
    spec = importlib.util.spec_from_file_location("env_source", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.setup_from_path(sys.argv[2], device="cpu", architecture="orb-v3-direct-20-omat")
    except ValueError as exc:
        print(f"REFUSED {exc}")
"""


def test_weights_missing_a_head_are_refused(family_env, tmp_path):
    root = family_env(ENV)
    source = root / "envs" / ENV / "env_source.py"
    out = run_in_env(root, ENV, LOAD_WITHOUT_STRESS_HEAD, source, tmp_path / "no-stress.pt")
    assert f"REFUSED {tmp_path / 'no-stress.pt'} does not fit architecture '{DIRECT}'" in out
    assert "no weights for the stress head(s)" in out
