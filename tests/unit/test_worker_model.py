"""The worker's model side, in-process: env-source loading and ModelRunner paths."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from ase.build import bulk, molecule
from ase.calculators.calculator import BaseCalculator, Calculator, all_changes
from ase.calculators.emt import EMT

from rootstock.worker.dtype import detect_model_dtype, find_module
from rootstock.worker.model import ModelRunner, WeightsNotLoaded, load_env_source, make_calculator

pytestmark = pytest.mark.timeout(60)

ENV_TEMPLATE = """
CHECKPOINTS = {{"m": "x"}}

def setup(checkpoint, device="cuda", **kw):
    return {value!r}
"""


def config_for(atoms, **extra):
    return {
        "rootstock": 1,
        "numbers": atoms.numbers.tolist(),
        "pbc": atoms.pbc.tolist(),
        "info": {},
        **extra,
    }


def test_env_source_is_compiled_afresh_even_with_the_same_size_and_mtime(tmp_path):
    path = tmp_path / "env_source.py"
    path.write_text(ENV_TEMPLATE.format(value="aaaa"))
    stamp = os.stat(path)
    assert load_env_source(path).setup("m") == "aaaa"
    path.write_text(ENV_TEMPLATE.format(value="bbbb"))  # same size ...
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # ... and same mtime
    assert load_env_source(path).setup("m") == "bbbb"
    assert not (tmp_path / "__pycache__").exists()


def test_setup_must_return_a_calculator(tmp_path):
    path = tmp_path / "env_source.py"
    path.write_text(ENV_TEMPLATE.format(value="not a calculator"))
    with pytest.raises(TypeError, match="not an ASE calculator"):
        make_calculator(load_env_source(path), "m", "cpu", {})


def test_weights_need_setup_from_path(tmp_path):
    path = tmp_path / "env_source.py"
    path.write_text(ENV_TEMPLATE.format(value=1))
    with pytest.raises(AttributeError, match="setup_from_path"):
        make_calculator(load_env_source(path), "m:custom", "cpu", {}, weights="w.pt")


def run_steps(runner, atoms, steps=4):
    out = []
    for step in range(steps):
        atoms.positions[step % len(atoms)] += 0.01
        if step == 2:
            atoms.cell[0, 0] += 0.05
        out.append(runner.compute(atoms.cell.array.copy(), atoms.positions.copy()))
    return out


def reference(atoms):
    ref = atoms.copy()
    ref.calc = EMT()
    return (
        ref.get_potential_energy(),
        ref.get_forces(),
        -ref.get_volume() * ref.get_stress(voigt=False),
    )


def test_direct_path_matches_the_public_ase_path():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 2, 2)
    atoms.rattle(0.05, seed=1)
    runner = ModelRunner(EMT())
    assert runner._direct
    runner.configure(config_for(atoms, stress=True))
    work = atoms.copy()
    energy, forces, virial, _ = run_steps(runner, work)[-1]
    ref_e, ref_f, ref_v = reference(work)
    assert energy == pytest.approx(ref_e, abs=1e-12)
    np.testing.assert_allclose(forces, ref_f, atol=1e-12)
    np.testing.assert_allclose(virial, ref_v, atol=1e-12)


class EnergyFirst(BaseCalculator):
    """A calculator with its own property plumbing (not an ase Calculator)."""

    implemented_properties = ("energy", "forces")

    def __init__(self):
        super().__init__()
        self.inner = EMT()

    def calculate(self, atoms, properties, system_changes):
        self.inner.calculate(atoms, properties, system_changes)
        self.results = dict(self.inner.results)


class LazyForces(Calculator):
    """Computes only what it is asked for: the worker must fill in the rest."""

    implemented_properties = ("energy", "forces")

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        inner = EMT()
        inner.calculate(self.atoms, ["energy", "forces"], all_changes)
        self.results = {"energy": inner.results["energy"]}
        if "forces" in properties and "energy" not in properties:
            self.results["forces"] = inner.results["forces"]


@pytest.mark.parametrize("calc", [EnergyFirst(), LazyForces()])
def test_calculators_with_their_own_plumbing_take_the_public_path(calc):
    atoms = molecule("CO")
    atoms.center(vacuum=3.0)
    runner = ModelRunner(calc)
    runner.configure(config_for(atoms))
    energy, forces, _virial, _ = runner.compute(atoms.cell.array, atoms.positions)
    ref = atoms.copy()
    ref.calc = EMT()
    assert energy == pytest.approx(ref.get_potential_energy(), abs=1e-12)
    np.testing.assert_allclose(forces, ref.get_forces(), atol=1e-12)


def test_info_reaches_the_model_and_a_new_config_resets_its_cache():
    seen = []

    class InfoEcho(Calculator):
        implemented_properties = ("energy", "forces")

        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, properties, system_changes)
            seen.append(dict(atoms.info))
            self.results = {
                "energy": float(atoms.info.get("charge", 0)),
                "forces": np.zeros((len(atoms), 3)),
            }

    atoms = molecule("H2O")
    runner = ModelRunner(InfoEcho())
    runner.configure(config_for(atoms, info={"charge": 1}))
    assert runner.compute(atoms.cell.array, atoms.positions)[0] == 1
    runner.configure(config_for(atoms, info={"charge": -2}))
    assert runner.compute(atoms.cell.array, atoms.positions)[0] == -2
    assert seen == [{"charge": 1}, {"charge": -2}]


def test_standard_mode_tolerates_a_model_without_stress():
    class NoStress(EMT):
        implemented_properties = ("energy", "forces")

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    runner = ModelRunner(NoStress())
    runner.use_template(atoms)
    _, _, virial, _ = runner.compute(atoms.cell.array, atoms.positions)
    assert not virial.any()


def test_positions_without_species_explain_the_structure_flag():
    runner = ModelRunner(EMT())
    with pytest.raises(RuntimeError, match="--structure"):
        runner.compute(np.eye(3), np.zeros((1, 3)))


# --- extras, the model report and the dtype -------------------------------------------


def extra_json(runner, atoms):
    extra = runner.compute(atoms.cell.array, atoms.positions)[3]
    return json.loads(extra) if extra else None


def test_the_model_report_comes_once_and_extras_only_when_asked():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 2, 1)
    atoms.rattle(0.05, seed=2)
    runner = ModelRunner(EMT())
    runner.configure(config_for(atoms))
    # EMT advertises magmoms but fills only energies: the report follows the results.
    assert extra_json(runner, atoms) == {
        "model": {"dtype": "float64", "extras": ["energies"], "device": "cpu"}
    }
    assert extra_json(runner, atoms) is None  # nothing to say: empty extra bytes
    runner.configure(config_for(atoms, extras=["energies", "magmoms", "unknown"]))
    ref = atoms.copy()
    ref.calc = EMT()
    doc = extra_json(runner, atoms)
    # The report comes again after every INIT: a shared worker's next client learns it.
    assert doc.pop("model") == {"dtype": "float64", "extras": ["energies"], "device": "cpu"}
    assert set(doc) == {"energies"}
    assert set(extra_json(runner, atoms)) == {"energies"}
    np.testing.assert_allclose(doc["energies"], ref.get_potential_energies(), rtol=0, atol=1e-12)


def test_standard_servers_get_no_model_report():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    runner = ModelRunner(EMT())
    runner.use_template(atoms)
    assert runner.compute(atoms.cell.array, atoms.positions)[3] == b""


class WrongShapeMagmoms(EMT):
    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        self.results["magmoms"] = np.zeros(len(self.atoms) + 1)


def test_a_malformed_extra_names_the_property_and_the_shapes():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    runner = ModelRunner(WrongShapeMagmoms())
    runner.configure(config_for(atoms, extras=["magmoms"]))
    with pytest.raises(
        ValueError, match=r"'magmoms' has shape \(5,\), expected \(4,\) or \(4, 3\)"
    ):
        runner.compute(atoms.cell.array, atoms.positions)


@pytest.mark.skipif("torch" in sys.modules, reason="torch is loaded in this process")
def test_a_model_without_torch_runs_in_float64():
    assert detect_model_dtype(EMT()) == "float64"


class Network:
    """Stands for torch.nn.Module: find_module only tests ``isinstance``."""


class Holder:
    def __init__(self, **attributes):
        self.__dict__.update(attributes)


class PredictorProperty:
    """A calculator that exposes its predictor through a property, not __dict__."""

    def __init__(self, network):
        self._hidden = Holder(model=network)

    @property
    def predictor(self):
        return self._hidden


@pytest.mark.parametrize(
    "make",
    [
        lambda net: Holder(model=net),
        lambda net: Holder(models=[net, Network()]),
        lambda net: Holder(predictor=Holder(model=net)),
        lambda net: Holder(potential={"main": net}),
        lambda net: PredictorProperty(net),
    ],
    ids=["model", "models[0]", "predictor.model", "potential[key]", "property"],
)
def test_the_network_is_found_one_or_two_levels_down(make):
    network = Network()
    assert find_module(make(network), Network) is network


def test_the_network_search_stops_two_levels_down():
    deep = Holder(a=Holder(b=Holder(c=Network())))
    assert find_module(deep, Network) is None
    assert find_module(Holder(x=1, y="s", z=np.zeros(3), w=None), Network) is None


def test_weights_that_setup_from_path_cannot_load_name_the_path(tmp_path):
    path = tmp_path / "env_source.py"
    path.write_text(
        'CHECKPOINTS = {"m:custom": None}\n'
        "def setup_from_path(path, device='cuda', **kw):\n"
        "    raise KeyError('no state_dict in the file')\n"
    )
    weights = tmp_path / "w.pt"
    weights.write_text("junk")
    with pytest.raises(WeightsNotLoaded) as caught:
        make_calculator(load_env_source(path), "m:custom", "cpu", {}, weights=str(weights))
    message = str(caught.value)
    assert f"weights file {weights}" in message
    assert "KeyError" in message and "no state_dict" in message
    assert isinstance(caught.value.__cause__, KeyError)
