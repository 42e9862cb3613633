"""mlipx relaxes structures on Rootstock EMT workers; results match in-process EMT.

mlipx 0.1.5 runs each node as a DVC stage (``dvc repro`` -> ``zntrack run``), so each
test works in a fresh git + DVC repository under tmp_path, offline, and checks that
no worker outlives the stages. Other pytest processes of the run use the same root at
the same time, so the workers looked for are the ones carrying this test's own mark in
their environment (the stages and their workers inherit it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import ase.io
import mlipx
import numpy as np
import pytest
import zntrack
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.optimize import LBFGS

from rootstock.errors import UsageError
from rootstock.integrations.mlipx import rootstock_model
from rootstock.runtime.calculator import RootstockCalculator

# Each deadline also covers the session's one uv build of the root, which the first
# test of a run pays (runtime_isolation needs it).
pytestmark = pytest.mark.usefixtures("runtime_isolation")

DOCS = Path(__file__).parents[2] / "docs" / "integrations.md"
EXAMPLE = re.compile(r"<!-- example: mlipx -->\s*```python\n(.*?)```\s*<!-- /example -->", re.S)
# The example's second checkpoint, swapped for the second EMT id this root serves.
DOCS_CHECKPOINTS = 'checkpoints = ["emt", "chgnet-0.3.0"]'
TEST_CHECKPOINTS = 'checkpoints = ["emt", "emt-offset-0"]'
# Both ids are plain EMT in their own workers; float64 over the socket.
CLOSE = {"rtol": 0, "atol": 1e-10}


def _rattled_cu() -> Atoms:
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True) * (2, 2, 2)  # 32 atoms
    atoms.rattle(0.05, seed=0)
    return atoms


def _emt_relaxation(atoms: Atoms, fmax: float) -> list[Atoms]:
    """In-process EMT under mlipx's default optimizer: a copy of every step."""
    atoms = atoms.copy()
    atoms.calc = EMT()
    steps: list[Atoms] = []

    def record() -> None:
        frame = atoms.copy()
        frame.info["energy"] = atoms.get_potential_energy()
        steps.append(frame)

    dyn = LBFGS(atoms, logfile=None)
    dyn.attach(record)
    dyn.run(fmax=fmax)
    return steps


def _assert_matches_emt(frames: list[Atoms], reference: list[Atoms]) -> tuple[float, float]:
    """Same steps, energies and positions; returns (max |dE|, max |dx|)."""
    assert len(frames) == len(reference)
    energies = np.array([f.get_potential_energy() for f in frames])
    ref_energies = np.array([r.info["energy"] for r in reference])
    np.testing.assert_allclose(energies, ref_energies, **CLOSE)
    positions = np.array([f.positions for f in frames])
    ref_positions = np.array([r.positions for r in reference])
    np.testing.assert_allclose(positions, ref_positions, **CLOSE)
    return (
        float(np.abs(energies - ref_energies).max()),
        float(np.abs(positions - ref_positions).max()),
    )


# Set to the test's repository for everything the test starts; workers inherit it.
STAGE_MARK_ENV = "ROOTSTOCK_TEST_MLIPX_REPO"


def _workers_of(root: Path, mark: str) -> list[int]:
    """Pids of live processes whose command line names ``root`` (workers of it) and
    whose environment holds ``mark`` (started by this test, not by another pytest
    process of the run using the same root)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if str(root).encode() in cmdline and state not in ("Z", "X") and mark.encode() in environ:
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def dvc_repo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_built_root: Path
) -> Iterator[Path]:
    """A git + DVC repository as the cwd, DVC offline; no worker of the root after
    that this test started."""
    repo = tmp_path / "repo"
    repo.mkdir()
    mark = f"{STAGE_MARK_ENV}={repo}"
    monkeypatch.setenv(STAGE_MARK_ENV, str(repo))
    # Each stage spawns its own workers (a pooled one would be the daemon's child and
    # could predate the mark).
    monkeypatch.delenv("ROOTSTOCK_POOL", raising=False)
    monkeypatch.chdir(repo)
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    # dvc repro runs `zntrack run` and the recipe runs `python`: this interpreter's.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    yield repo
    assert not _workers_of(fake_built_root, mark), "a worker outlived the mlipx stages"


def _init_repo() -> None:
    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run(["dvc", "init", "-q"], check=True)


@pytest.mark.timeout(600)
def test_rootstock_model_is_mlipx_generic_calculator(fake_built_root: Path) -> None:
    model = rootstock_model("emt", root=fake_built_root, setup_kwargs={})
    assert isinstance(model, mlipx.GenericASECalculator)
    assert (model.module, model.class_name, model.device) == (
        "rootstock",
        "RootstockCalculator",
        None,
    )
    assert model.kwargs == {
        "checkpoint": "emt",
        "device": "cpu",
        "root": str(fake_built_root),
        "setup_kwargs": {},
    }
    assert model.get_spec() is None
    atoms = _rattled_cu()
    with model.get_calculator() as calc:
        assert isinstance(calc, RootstockCalculator)
        atoms.calc = calc
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
    reference = atoms.copy()
    reference.calc = EMT()
    np.testing.assert_allclose(energy, reference.get_potential_energy(), **CLOSE)
    np.testing.assert_allclose(forces, reference.get_forces(), **CLOSE)


@pytest.mark.timeout(600)
def test_rootstock_model_refuses_what_params_yaml_cannot_hold() -> None:
    with pytest.raises(UsageError, match=r"params\.yaml") as info:
        rootstock_model("emt", setup_kwargs={"model": object()})
    assert info.value.hint
    with pytest.raises(UsageError, match="checkpoint"):
        rootstock_model("")


@pytest.mark.timeout(600)
def test_import_without_mlipx_names_the_extra() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["mlipx"] = None
        from rootstock.errors import MissingExtra
        try:
            import rootstock.integrations.mlipx
        except MissingExtra as exc:
            print(exc.hint)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True
    ).stdout
    assert "pip install 'rootstock[mlipx]'" in out


@pytest.mark.timeout(600)
def test_structure_optimization_compare_two_emt_ids(dvc_repo: Path, fake_built_root: Path) -> None:
    _init_repo()
    ase.io.write("cu.xyz", _rattled_cu())
    fmax = 0.01
    project = zntrack.Project()
    with project:
        data = mlipx.LoadDataFile(path="cu.xyz")
        nodes = [
            mlipx.StructureOptimization(
                data=data.frames,
                model=rootstock_model(checkpoint, root=str(fake_built_root)),
                fmax=fmax,
                name=f"relax-{checkpoint}",
            )
            for checkpoint in ("emt", "emt-offset-0")
        ]
    project.repro()

    reference = _emt_relaxation(ase.io.read("cu.xyz"), fmax)  # what mlipx loads
    figures = [_assert_matches_emt(node.frames, reference) for node in nodes]
    print("mlipx StructureOptimization vs EMT (max |dE| eV, max |dx| A):", figures)
    assert len(reference) > 5  # a real relaxation, not the first frame alone

    comparison = mlipx.StructureOptimization.compare(*nodes)
    assert len(comparison["frames"]) == 2 * len(reference)
    assert set(comparison["figures"]) == {"energy_vs_steps", "adjusted_energy_vs_steps"}
    curves = [trace.y for trace in comparison["figures"]["energy_vs_steps"].data]
    np.testing.assert_allclose(curves[0], curves[1], **CLOSE)
    np.testing.assert_allclose(curves[0], [r.info["energy"] for r in reference], **CLOSE)


@pytest.mark.timeout(600)
def test_relax_recipe_cli(dvc_repo: Path, fake_built_root: Path) -> None:
    ase.io.write("cu.xyz", _rattled_cu())
    Path("models.py").write_text(
        textwrap.dedent(
            f"""
            from rootstock.integrations.mlipx import rootstock_model

            MODELS = {{
                "emt": rootstock_model("emt", root={str(fake_built_root)!r}),
                "emt-offset-0": rootstock_model("emt-offset-0", root={str(fake_built_root)!r}),
            }}
            """
        )
    )
    mlipx_cli = Path(sys.executable).parent / "mlipx"
    run = subprocess.run(
        [str(mlipx_cli), "recipes", "relax", "--initialize", "--repro", "--datapath", "cu.xyz"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, (
        "mlipx recipes relax failed (mlipx 0.1.5's CLI imports zndraw, which needs "
        f"asebytes<0.3):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    )

    reference = _emt_relaxation(ase.io.read("cu.xyz"), fmax=0.1)  # the recipe's fmax
    for model in ("emt", "emt-offset-0"):
        node = zntrack.from_rev(f"{model}_0_StructureOptimization")
        assert node.model.kwargs["checkpoint"] == model
        _assert_matches_emt(node.frames, reference)


def _example_source() -> str:
    match = EXAMPLE.search(DOCS.read_text())
    assert match is not None, f"no <!-- example: mlipx --> block in {DOCS}"
    source = match.group(1)
    assert DOCS_CHECKPOINTS in source, f"the example no longer sets {DOCS_CHECKPOINTS}"
    return source.replace(DOCS_CHECKPOINTS, TEST_CHECKPOINTS)


@pytest.mark.timeout(600)
def test_docs_example_runs(
    dvc_repo: Path, fake_built_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace: dict = {"root": str(fake_built_root)}
    exec(compile(_example_source(), "docs/integrations.md", "exec"), namespace)
    reference = _emt_relaxation(ase.io.read("cu.xyz"), fmax=0.05)
    for node in namespace["relax"].values():
        _assert_matches_emt(node.frames, reference)
    out = capsys.readouterr().out
    assert f"emt {len(reference)} frames" in out
    assert f"emt-offset-0 {len(reference)} frames" in out
