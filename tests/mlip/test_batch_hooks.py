"""Every shipped ``evaluate_batch`` hook gives the numbers of one-at-a-time calls.

"No hook ships without a passing equality test": for CHGNet, SevenNet, MACE and ORB
(conservative and direct), on a small mixed batch (2-16 atoms, two elements, rattled,
periodic, plus one non-periodic cluster and, where the model has a species table, one
structure with an element it does not know):

1. **In the env's own Python** (no rootstock between): the env file's
   ``evaluate_batch(calc, images, properties)`` against ``atoms.calc = calc`` one
   structure at a time, with the same calculator from ``setup()``/``setup_from_path()``.
   The structure the model cannot take must fail in its own slot in both. A single call
   made after the batch must still agree (the hook leaves the calculator as it was:
   SevenNet's model is switched to batch mode and back).
2. **Through RootstockCalculator**: ``calc.calculate_batch(images, errors="return")``
   (one BATCH round trip; the worker calls the hook) against single calls through the
   same calculator.

Tolerances: MACE runs float64, so rtol 1e-6 with atol 1e-6 eV/Å (forces) and 1e-7
eV/Å^3 (stress). The others run float32, where a batch sums in another order than a
single structure; each uses its family's documented float32 bound (docs/models.md and
its test_family_*.py), relative to the largest value of that quantity in the batch.
Measured on this 2-core CPU (2026-12-02; energy / forces / stress, the largest
difference relative to the largest value in the batch; calculate_batch gave the same):
CHGNet 2.9e-7 / 5.9e-7 / 1.2e-6 against 1e-3; SevenNet (``sevennet-0``) 7.4e-8 /
1.6e-7 / 1.9e-7 against 1e-4; ORB conservative 1.4e-6 / 1.6e-6 / 1.2e-6 and direct
2.8e-6 / 3.0e-6 / 8e-7 against 5e-5; MACE 0 / 2.8e-16 / 2.8e-16 (7e-15 through the
worker) against 1e-6.

Runtime beyond the family env builds (shared with test_family_*.py): 154 s for the
file on two cores with the envs built (CHGNet 75 s, SevenNet 25 s, MACE 31 s, ORB 24 s).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk

from tests.mlip.family import built_first, run_in_env

pytestmark = [pytest.mark.mlip, pytest.mark.timeout(900)]

# A loop and the hook on the same calculator, in the env's Python; then one more
# single call, to show the hook left the calculator as it found it.
BATCH_AGAINST_LOOP = textwrap.dedent("""
    import importlib.util, json, os, sys
    import numpy as np
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from ase import Atoms
    from ase.stress import full_3x3_to_voigt_6_stress

    request = json.loads(sys.argv[2])
    spec = importlib.util.spec_from_file_location("env_source", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    sys.modules["env_source"] = module
    spec.loader.exec_module(module)
    images = [Atoms(symbols=s["symbols"], positions=s["positions"], cell=s["cell"],
                    pbc=s["pbc"]) for s in request["structures"]]
    properties = tuple(request["properties"])

    def plain(result):
        if isinstance(result, Exception):
            return {"error": f"{type(result).__name__}: {result}"}
        out = {}
        for name in (*properties, "energy"):
            if result.get(name) is not None:
                value = np.asarray(result[name], dtype=float)
                if name == "stress" and value.shape == (3, 3):
                    value = full_3x3_to_voigt_6_stress(value)
                out[name] = value.tolist()
        return out

    def single(calc, atoms):
        atoms = atoms.copy()
        try:
            atoms.calc = calc
            out = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
            if "stress" in properties and atoms.pbc.all():
                out["stress"] = atoms.get_stress()
            for name in properties:
                if name not in out and name != "stress":
                    out[name] = calc.results.get(name)
        except Exception as exc:
            return exc
        return out

    reports = []
    for model in request["models"]:
        if model["weights"] is not None:
            calc = module.setup_from_path(model["weights"], device="cpu", **model["kwargs"])
        else:
            calc = module.setup(model["checkpoint"], device="cpu", **model["kwargs"])
        loop = [plain(single(calc, atoms)) for atoms in images]
        batch = [plain(r) for r in module.evaluate_batch(calc, images, properties)]
        reports.append({"loop": loop, "batch": batch, "after": plain(single(calc, images[0]))})
    print("ROOTSTOCK-RESULT " + json.dumps(reports))
""")

# The family test's random MACE, for nickel and copper: a batch must mix species.
MACE_ELEMENTS = ("Ni", "Cu")


def random_mace_script() -> str:
    """test_family_mace's builder, widened from Cu to Ni and Cu (still tiny, random)."""
    from tests.mlip.test_family_mace import BUILD_RANDOM_MACE

    script = (
        BUILD_RANDOM_MACE.replace("num_elements=1", "num_elements=2")
        .replace("np.array([-3.75])", "np.array([-3.6, -3.75])")
        .replace("atomic_numbers=[29]", "atomic_numbers=[28, 29]")
    )
    assert "atomic_numbers=[28, 29]" in script and "num_elements=2" in script, (
        "test_family_mace's builder changed; update this edit"
    )
    return script


def mixed_batch(first: str, second: str) -> list[Atoms]:
    """Five structures of 2-16 atoms: four rattled periodic cells mixing ``first`` and
    ``second`` in different sizes and proportions, and one non-periodic cluster."""
    images = []
    atoms = bulk(first, "fcc", a=3.6, cubic=True)
    atoms.rattle(0.05, seed=1)
    images.append(atoms)
    atoms = bulk(first, "fcc", a=3.6) * (2, 2, 2)
    atoms.rattle(0.05, seed=2)
    atoms.symbols[[1, 4, 6]] = second
    images.append(atoms)
    atoms = bulk(second, "fcc", a=3.7) * (2, 1, 1)
    atoms.rattle(0.05, seed=3)
    images.append(atoms)
    atoms = bulk(first, "fcc", a=3.6, cubic=True) * (2, 2, 1)
    atoms.rattle(0.05, seed=4)
    atoms.symbols[::3] = second
    images.append(atoms)
    cluster = [[0, 0, 0], [2.4, 0, 0], [0, 2.4, 0], [1.2, 1.2, 2.0]]
    atoms = Atoms(f"{first}2{second}2", positions=cluster)
    atoms.rattle(0.05, seed=5)
    images.append(atoms)
    return images


def unknown_species(symbol: str) -> Atoms:
    """A periodic cell of an element the model's species table lacks."""
    atoms = bulk(symbol, "fcc", a=4.1, cubic=True)
    atoms.rattle(0.05, seed=6)
    return atoms


def _structure_json(atoms: Atoms) -> dict[str, Any]:
    return {
        "symbols": atoms.get_chemical_symbols(),
        "positions": atoms.get_positions().tolist(),
        "cell": atoms.get_cell().array.tolist(),
        "pbc": atoms.pbc.tolist(),
    }


def model(checkpoint: str | None = None, weights: Path | None = None, **kwargs: Any) -> dict:
    """One calculator for the in-env script: ``setup(checkpoint)`` or ``setup_from_path``."""
    return {
        "checkpoint": checkpoint,
        "weights": str(weights) if weights is not None else None,
        "kwargs": kwargs,
    }


def batch_against_loop(
    root: Path,
    env: str,
    models: list[dict],
    images: list[Atoms],
    properties: tuple[str, ...],
    build: tuple[str, list[Any]] | None = None,
) -> list[dict[str, Any]]:
    """Per model, ``{"loop", "batch", "after"}`` from the env's Python.

    ``build=(script, args)`` first saves random weights in the same run (one start of
    the env's Python instead of two): see :func:`tests.mlip.family.built_first`.
    """
    request = {
        "models": models,
        "structures": [_structure_json(a) for a in images],
        "properties": list(properties),
    }
    script = BATCH_AGAINST_LOOP if build is None else built_first(*build) + BATCH_AGAINST_LOOP
    source = root / "envs" / env / "env_source.py"
    out = run_in_env(root, env, script, source, json.dumps(request), timeout=600)
    line = next(x for x in reversed(out.splitlines()) if x.startswith("ROOTSTOCK-RESULT "))
    return json.loads(line.removeprefix("ROOTSTOCK-RESULT "))


def _scale(results: list[dict[str, Any]], name: str) -> float:
    values = [np.abs(np.asarray(r[name])).max() for r in results if name in r]
    return float(max(values, default=0.0)) or 1.0


def assert_batch_matches(
    batch: list[dict[str, Any]],
    loop: list[dict[str, Any]],
    rtol: float,
    fails: frozenset[int] | set[int] = frozenset(),
) -> dict[str, float]:
    """Each batched result equals its single call to ``rtol`` (plus the brief's atol,
    or ``rtol`` times the batch's largest value for float32); the structures in
    ``fails`` fail in both, and no other does. Returns the largest differences."""
    assert len(batch) == len(loop)
    ok = [r for r in loop if "error" not in r]
    atol = {
        "forces": max(1e-6, rtol * _scale(ok, "forces")) if rtol > 1e-6 else 1e-6,
        "stress": max(1e-7, rtol * _scale(ok, "stress")) if rtol > 1e-6 else 1e-7,
    }
    worst = {"energy": 0.0, "forces": 0.0, "stress": 0.0}
    for index, (ours, single) in enumerate(zip(batch, loop, strict=True)):
        if index in fails:
            assert "error" in single, f"structure {index} should fail one at a time"
            assert "error" in ours, f"structure {index}: the hook gave {sorted(ours)}"
            # The same exception class: the hook reports the model's own failure.
            assert ours["error"].split(":")[0] == single["error"].split(":")[0], (ours, single)
            continue
        assert "error" not in single and "error" not in ours, (index, single, ours)
        assert set(ours) >= set(single), (index, sorted(ours), sorted(single))
        assert ours["energy"] == pytest.approx(single["energy"], rel=rtol), index
        worst["energy"] = max(worst["energy"], abs(ours["energy"] / single["energy"] - 1))
        for name in single:
            if name == "energy":
                continue
            got, want = np.asarray(ours[name]), np.asarray(single[name])
            assert got.shape == want.shape, (index, name)
            tol = atol.get(name, rtol * _scale(ok, name))
            np.testing.assert_allclose(got, want, rtol=rtol, atol=tol, err_msg=f"{index} {name}")
            if name in worst:
                difference = float(np.abs(got - want).max()) / _scale(ok, name)
                worst[name] = max(worst[name], difference)
    return worst


def assert_hook_matches(report: dict[str, Any], rtol: float, fails: set[int]) -> dict:
    """The hook against the loop, and the single call after the hook against the first."""
    worst = assert_batch_matches(report["batch"], report["loop"], rtol, fails)
    assert_batch_matches([report["after"]], [report["loop"][0]], rtol)
    return worst


# --- through RootstockCalculator: calculate_batch against single calls ------------------


def through_rootstock(
    root: Path,
    checkpoint: str,
    images: list[Atoms],
    properties: tuple[str, ...],
    *,
    weights: Path | None = None,
    setup_kwargs: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(calculate_batch results, single-call results) from one calculator."""
    from rootstock import RootstockCalculator
    from rootstock.errors import WorkerError

    with RootstockCalculator(
        root=root, checkpoint=checkpoint, device="cpu", weights=weights, setup_kwargs=setup_kwargs
    ) as calc:
        batch = calc.calculate_batch(images, properties=properties, errors="return")
        singles: list[dict[str, Any]] = []
        for atoms in images:
            atoms = atoms.copy()
            atoms.calc = calc
            try:
                single = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
                if "stress" in properties and atoms.pbc.all():
                    single["stress"] = atoms.get_stress()
                for name in properties:
                    if name not in single and name != "stress":
                        single[name] = calc.get_property(name, atoms)
            except WorkerError as exc:
                single = {"error": f"{type(exc).__name__}: {exc}"}
            singles.append(single)
    plain = []
    for result in batch:
        if isinstance(result, Exception):
            plain.append({"error": f"{type(result).__name__}: {result}"})
        else:
            plain.append({k: v for k, v in result.items() if k in (*properties, "energy")})
    return plain, singles


# --- the families ------------------------------------------------------------------------


def test_chgnet_hook_equals_one_at_a_time(family_env, same_threads):
    """CHGNet (shipped 0.3.0 weights, float32, family bound 1e-3), magmoms included.
    The non-periodic cluster has no cell for CHGNet's graph: it fails in both."""
    root = family_env("chgnet")
    images = mixed_batch("Cu", "Au")
    properties = ("energy", "forces", "stress", "magmoms")
    (report,) = batch_against_loop(root, "chgnet", [model("chgnet-0.3.0")], images, properties)
    print("chgnet hook vs loop (max relative):", assert_hook_matches(report, 1e-3, {4}))
    batch, singles = through_rootstock(root, "chgnet-0.3.0", images, properties)
    print("chgnet calculate_batch vs single:", assert_batch_matches(batch, singles, 1e-3, {4}))


def test_sevennet_hook_equals_one_at_a_time(family_env, same_threads):
    """SevenNet (shipped ``sevennet-0``, float32, family bound 1e-4), per-atom energies
    included; oganesson is outside its type map and fails in its own slot."""
    root = family_env("sevennet")
    images = [*mixed_batch("Cu", "Au"), unknown_species("Og")]
    properties = ("energy", "forces", "stress", "energies")
    (report,) = batch_against_loop(root, "sevennet", [model("sevennet-0")], images, properties)
    print("sevennet hook vs loop (max relative):", assert_hook_matches(report, 1e-4, {5}))
    batch, singles = through_rootstock(root, "sevennet-0", images, properties)
    print("sevennet calculate_batch vs single:", assert_batch_matches(batch, singles, 1e-4, {5}))


def test_mace_hook_equals_one_at_a_time(family_env, same_threads, tmp_path):
    """MACE (a random float64 Ni/Cu ScaleShiftMACE): rtol 1e-6, atol 1e-6 eV/Å and
    1e-7 eV/Å^3; gold is outside its element table and fails in its own slot."""
    root = family_env("mace")
    weights = tmp_path / "random-mace-ni-cu.model"
    images = [*mixed_batch(*MACE_ELEMENTS), unknown_species("Au")]
    properties = ("energy", "forces", "stress", "energies")
    build = (random_mace_script(), [weights])
    (report,) = batch_against_loop(
        root, "mace", [model(weights=weights)], images, properties, build=build
    )
    print("mace hook vs loop (max relative):", assert_hook_matches(report, 1e-6, {5}))
    assert np.abs(np.asarray(report["loop"][1]["forces"])).max() > 1e-3  # not a flat model
    # Through rootstock the worker asks for what the test asks: energy, forces, stress.
    batch, singles = through_rootstock(
        root, "mace:custom", images, ("energy", "forces", "stress"), weights=weights
    )
    print("mace calculate_batch vs single:", assert_batch_matches(batch, singles, 1e-6, {5}))


def test_orb_hook_equals_one_at_a_time(family_env, same_threads, tmp_path):
    """ORB v3 (random full-size conservative and direct models, float32, family bound
    5e-5): the conservative model's gradient forces and stress, the direct model's
    heads. ORB embeds every element, so no structure fails."""
    from tests.mlip.test_family_orb import BUILD_RANDOM_ORB, CONSERVATIVE, DIRECT

    root = family_env("orb")
    files = {kind: tmp_path / f"random-orb-v3-{kind}.pt" for kind in ("conservative", "direct")}
    images = mixed_batch("Cu", "Au")
    properties = ("energy", "forces", "stress")
    models = [
        model(weights=files["conservative"], architecture=CONSERVATIVE),
        model(weights=files["direct"], architecture=DIRECT),
    ]
    build = (BUILD_RANDOM_ORB, [files["conservative"], files["direct"]])
    conservative, direct = batch_against_loop(root, "orb", models, images, properties, build)
    print("orb conservative hook vs loop:", assert_hook_matches(conservative, 5e-5, set()))
    print("orb direct hook vs loop:", assert_hook_matches(direct, 5e-5, set()))
    batch, singles = through_rootstock(
        root,
        "orb:custom",
        images,
        properties,
        weights=files["conservative"],
        setup_kwargs={"architecture": CONSERVATIVE},
    )
    print("orb calculate_batch vs single:", assert_batch_matches(batch, singles, 5e-5))
