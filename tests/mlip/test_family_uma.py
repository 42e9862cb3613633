"""UMA (fairchem-core): a tiny random UMA model through ``uma:custom``, offline.

The named checkpoints sit in a gated hub repository, so the test builds its own
model in the env's Python: the eSCN-MD mixture-of-linear-experts backbone
(``eSCNMDMoeBackbone``, two experts) with small sizes and a dataset-specific
energy/forces/stress head for two tasks (``omat``, ``omol``), saved as the
``MLIPInferenceCheckpoint`` fairchem's ``load_predict_unit`` reads. It runs on the
CPU with ``inference_settings="traineval"`` (the default compiles the model).

The named checkpoints are covered as far as an offline machine allows: a fetch
that never happened fails with an error naming the files, and ``download()``
is checked against a hub cache laid out by hand, to prove it resolves every file
an offline ``setup()`` reads (the checkpoint *and* the element references).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rootstock.errors import WorkerError
from rootstock.ops.consistency import check_consistency
from tests.mlip.family import (
    agreement,
    assert_agree,
    in_process_models,
    model_request,
    run_in_env,
    structure,
)

pytestmark = [pytest.mark.mlip, pytest.mark.timeout(1200)]

CPU = {"inference_settings": "traineval"}
TASK = "omat"
# The same model, the same threads, run twice: only float32 summation order differs.
RTOL = 1e-5

# argv[1]: where to save. rmsd scales energy, forces and stress alike (so forces
# stay the energy's gradient) to eV-sized numbers instead of a random init's 0.05.
BUILD_TINY_UMA = """
    import sys
    import hydra
    import torch
    from fairchem.core.units.mlip_unit.api.inference import MLIPInferenceCheckpoint

    torch.manual_seed(0)
    datasets = ["omat", "omol"]
    backbone = {
        "model": "fairchem.core.models.uma.escn_moe.eSCNMDMoeBackbone",
        "max_num_elements": 100, "sphere_channels": 16, "lmax": 2, "mmax": 2,
        "otf_graph": True, "max_neighbors": 300, "cutoff": 6.0, "edge_channels": 16,
        "num_distance_basis": 16, "direct_forces": False, "regress_forces": True,
        "regress_stress": True, "num_layers": 2, "hidden_channels": 16,
        "norm_type": "rms_norm_sh", "act_type": "gate", "ff_type": "spectral",
        "chg_spin_emb_type": "rand_emb", "dataset_mapping": {d: d for d in datasets},
        "use_dataset_embedding": True, "num_experts": 2,
        "use_composition_embedding": True, "moe_type": "so2",
    }
    model_config = {
        "_target_": "fairchem.core.models.base.HydraModel",
        "model_id": "tiny-uma-test",
        "backbone": backbone,
        "heads": {"efs": {
            "module": "fairchem.core.models.uma.escn_moe.DatasetSpecificSingleHeadWrapper",
            "dataset_names": datasets,
            "head_cls": "fairchem.core.models.uma.escn_md.MLP_EFS_Head",
            "head_kwargs": {"wrap_property": False},
        }},
        "pass_through_head_outputs": True,
    }

    def task(dataset, prop, level, dim):
        return {
            "_target_": "fairchem.core.units.mlip_unit.mlip_unit.Task",
            "name": f"{dataset}_{prop}", "level": level, "property": prop,
            "out_spec": {"_target_": "fairchem.core.units.mlip_unit.mlip_unit.OutputSpec",
                         "dim": dim, "dtype": "float32"},
            "normalizer": {"_target_": "fairchem.core.modules.normalization.normalizer.Normalizer",
                           "mean": 0.0, "rmsd": 10.0},
            "datasets": [dataset],
        }

    tasks = [t for d in datasets for t in (task(d, "energy", "system", [1]),
                                           task(d, "forces", "atom", [3]),
                                           task(d, "stress", "system", [1, 9]))]
    model = hydra.utils.instantiate(model_config)
    ema = torch.optim.swa_utils.AveragedModel(model).state_dict()
    torch.save(MLIPInferenceCheckpoint(model_config=model_config,
                                       model_state_dict=model.state_dict(),
                                       ema_state_dict=ema, tasks_config=tasks),
               sys.argv[1])
"""

# argv[1]: env_source.py; argv[2]: the tiny checkpoint, served as uma-s-1p1 from a
# hub cache laid out by hand under $FAIRCHEM_CACHE_DIR; argv[3]: "full" caches
# the references too, "weights" only the checkpoint. Prints one JSON line.
OFFLINE_FETCH = """
    import importlib.util, json, os, pathlib, shutil, sys
    cache = pathlib.Path(os.environ["FAIRCHEM_CACHE_DIR"])
    repo = cache / "models--facebook--UMA"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(snapshot.name)
    (snapshot / "checkpoints").mkdir(parents=True)
    shutil.copyfile(sys.argv[2], snapshot / "checkpoints" / "uma-s-1p1.pt")
    if sys.argv[3] == "full":
        (snapshot / "references").mkdir()
        (snapshot / "references" / "iso_atom_elem_refs.yaml").write_text(
            "omat_elem_refs:\\n  29: -0.25\\n")
        (snapshot / "references" / "form_elem_refs.yaml").write_text(
            "refs:\\n  omat:\\n    Cu: -4.0\\n")
    spec = importlib.util.spec_from_file_location("env_source", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def attempt(call):
        try:
            return {"ok": True, "value": str(call())}
        except Exception as err:
            return {"ok": False, "value": f"{type(err).__name__}: {err}"}

    out = {"download": attempt(lambda: module.download("uma-s-1p1"))}
    def compute():
        from ase.build import bulk
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
        atoms.calc = module.setup("uma-s-1p1", device="cpu", task="omat",
                                  inference_settings="traineval")
        return atoms.get_potential_energy()
    out["setup"] = attempt(compute)
    print("ROOTSTOCK-RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def uma_root(family_env) -> Path:
    """The family root with environments/uma.py built into it."""
    return family_env("uma")


@pytest.fixture(scope="module")
def built_uma(uma_root: Path, tmp_path_factory) -> tuple[Path, dict]:
    """A tiny random UMA MLIPInferenceCheckpoint, built once in the env's Python and, in
    the same run, loaded back from its file and run in-process: (file, results)."""
    path = tmp_path_factory.mktemp("uma") / "tiny-uma.pt"
    models = [model_request(weights=path, kwargs={"task": TASK, **CPU})]
    build = (BUILD_TINY_UMA, [path])
    (reference,) = in_process_models(uma_root, "uma", models, build=build)
    return path, reference


@pytest.fixture(scope="module")
def tiny_uma(built_uma: tuple[Path, dict]) -> Path:
    """The tiny random UMA checkpoint file."""
    return built_uma[0]


def compute_and_check(root: Path, weights: Path, setup_kwargs: dict):
    """Energy, forces, stress and the consistency report, all in one calculator session."""
    from rootstock import RootstockCalculator

    atoms = structure()
    with RootstockCalculator(
        root=root, checkpoint="uma:custom", device="cpu", weights=weights, setup_kwargs=setup_kwargs
    ) as calc:
        atoms.calc = calc
        ours = {
            "energy": atoms.get_potential_energy(),
            "forces": atoms.get_forces(),
            "stress": atoms.get_stress(),
        }
        report = check_consistency(atoms, calc, dtype="float32")
    return ours, report


def first_energy(root: Path, checkpoint: str, **kw) -> float:
    """Open a calculator session and compute one energy (for the failure tests)."""
    from rootstock import RootstockCalculator

    atoms = structure()
    with RootstockCalculator(root=root, checkpoint=checkpoint, device="cpu", **kw) as calc:
        atoms.calc = calc
        return atoms.get_potential_energy()


def test_tiny_uma_through_calculator_equals_in_process_and_is_consistent(
    uma_root: Path, built_uma: tuple[Path, dict]
):
    tiny_uma, reference = built_uma
    ours, report = compute_and_check(uma_root, tiny_uma, {"task": TASK, **CPU})
    figures = agreement(ours, reference)
    scale = {"energy": ours["energy"], "max_force": float(abs(ours["forces"]).max())}
    print(f"uma:custom {scale} agreement {figures}; consistency {json.dumps(report.to_dict())}")
    assert_agree(ours, reference, rtol=RTOL)
    assert abs(ours["energy"]) > 0.5 and abs(ours["forces"]).max() > 0.01, "non-trivial model"
    assert report.ok, report.message
    assert report.checks["stress"].mode == "gradient"


def test_custom_task_must_be_one_the_checkpoint_declares(uma_root: Path, tiny_uma: Path):
    kwargs = {"task": "oc20", **CPU}
    with pytest.raises(WorkerError, match=r"no task 'oc20'; choose one of omat, omol"):
        first_energy(uma_root, "uma:custom", weights=tiny_uma, setup_kwargs=kwargs)


def test_weights_uma_cannot_load_give_torchs_error(uma_root: Path, tmp_path: Path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a torch checkpoint\n" * 8)
    with pytest.raises(WorkerError, match=r"UnpicklingError") as caught:
        first_energy(uma_root, "uma:custom", weights=garbage, setup_kwargs={"task": TASK, **CPU})
    text = str(caught.value)
    assert str(garbage) in text
    assert "torch/serialization.py" in text, "torch's own traceback reaches the caller"


def test_named_checkpoint_never_fetched_fails_offline_naming_the_files(uma_root: Path):
    with pytest.raises(WorkerError, match=r"uma-s-1p1: the weights and references") as caught:
        first_energy(uma_root, "uma-s-1p1", setup_kwargs={"task": TASK, **CPU})
    text = str(caught.value)
    for name in ("checkpoints/uma-s-1p1.pt", "references/iso_atom_elem_refs.yaml"):
        assert name in text
    assert "rootstock add uma-s-1p1" in text


@pytest.mark.parametrize("cached", ["weights", "full"])
def test_download_resolves_what_offline_setup_reads(
    uma_root: Path, tiny_uma: Path, tmp_path: Path, monkeypatch, cached: str
):
    """With only the checkpoint cached, download() must fail as setup() does (the
    references are missing); with the references too, both work offline."""
    monkeypatch.setenv("FAIRCHEM_CACHE_DIR", str(tmp_path / "fairchem"))
    source = uma_root / "envs" / "uma" / "env_source.py"
    out = run_in_env(uma_root, "uma", OFFLINE_FETCH, source, tiny_uma, cached)
    line = next(x for x in reversed(out.splitlines()) if x.startswith("ROOTSTOCK-RESULT "))
    result = json.loads(line.removeprefix("ROOTSTOCK-RESULT "))
    if cached == "full":
        assert result["download"]["ok"], result
        assert result["download"]["value"].endswith("checkpoints/uma-s-1p1.pt")
        assert result["setup"]["ok"], result
        assert float(result["setup"]["value"]) != 0.0
    else:
        # The checkpoint alone resolves; what is missing is a reference file.
        assert not result["download"]["ok"], "download() skipped the element references"
        assert result["download"]["value"].startswith("LocalEntryNotFoundError"), result
        assert not result["setup"]["ok"], result
        assert "not in fairchem's cache" in result["setup"]["value"]
