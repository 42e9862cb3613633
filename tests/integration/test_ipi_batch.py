"""i-PI's batched socket mode (``batch_size`` in ``<ffsocket>``) against ``rootstock serve``.

A real i-PI runs PIMD with 4 beads; the EMT env of ``fake_built_root`` serves it
through ``rootstock serve``. The trajectory with batched exchanges (N structures per
POSDATA, short batches padded by i-PI) must be the one-at-a-time trajectory.
ASE's SocketIOCalculator and non-batched i-PI are covered by test_ipi_interop.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from ase.build import bulk
from ase.io import write

from .conftest import process_group

pytestmark = [
    pytest.mark.usefixtures("runtime_isolation"),
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        shutil.which("i-pi", path=os.path.dirname(sys.executable)) is None,
        reason="the i-PI package (ipi>=3.3) is not installed in this venv",
    ),
]

STEPS = 6
BEADS = 4

PIMD_INPUT = """\
<simulation verbosity="low" safe_stride="100">
  <output prefix="md">
    <properties stride="1" filename="out">
      [ step, potential{{electronvolt}}, pressure_md{{bar}} ]
    </properties>
    <checkpoint stride="1" overwrite="false" filename="chk"/>
  </output>
  <total_steps>{steps}</total_steps>
  <prng><seed>4242</seed></prng>
  <ffsocket name="rootstock" mode="unix" pbc="true">
    <address>rootstock</address>
    <timeout>60</timeout>
    <batch_size>{batch_size}</batch_size>
  </ffsocket>
  <system>
    <initialize nbeads="{beads}">
      <file mode="ase">start.xyz</file>
      <velocities mode="thermal" units="kelvin">300</velocities>
    </initialize>
    <forces><force forcefield="rootstock"/></forces>
    <motion mode="dynamics">
      <dynamics mode="nve"><timestep units="femtosecond">1.0</timestep></dynamics>
    </motion>
    <ensemble><temperature units="kelvin">300</temperature></ensemble>
  </system>
</simulation>
"""


def run_pimd(root: Path, workdir: Path, batch_size: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Run i-PI against ``rootstock serve``; the bead positions after each step and
    the properties table (step, potential, pressure)."""
    workdir.mkdir()
    atoms = bulk("Cu", "fcc", a=3.62, cubic=True)  # 4 atoms: a few ms per EMT call
    atoms.rattle(0.05, seed=3)
    write(workdir / "start.xyz", atoms, format="extxyz")
    (workdir / "input.xml").write_text(
        PIMD_INPUT.format(steps=STEPS, batch_size=batch_size, beads=BEADS)
    )
    sockets = Path(tempfile.mkdtemp(prefix="rootstock-ipi-"))
    ipi = str(Path(sys.executable).parent / "i-pi")
    serve = [
        sys.executable, "-m", "rootstock.cli.main", "serve", "emt",
        "--socket", f"{sockets}/ipi_rootstock", "--structure", str(workdir / "start.xyz"),
        "--root", str(root), "--device", "cpu", "--connect-timeout", "60",
    ]  # fmt: skip
    try:
        with (
            open(workdir / "ipi.log", "wb") as ipi_log,
            open(workdir / "serve.log", "wb") as serve_log,
            process_group(
                [ipi, "input.xml", "-S", f"{sockets}/ipi_"],
                cwd=workdir,
                stdout=ipi_log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONFAULTHANDLER": "1"},
            ) as server,
            process_group(serve, stdout=serve_log, stderr=subprocess.STDOUT) as worker,
        ):
            assert server.wait(timeout=180) == 0, (workdir / "ipi.log").read_text()
            assert worker.wait(timeout=60) == 0, (workdir / "serve.log").read_text()
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    announced = f"batched mode: {batch_size} structures per POSDATA"
    assert (announced in (workdir / "serve.log").read_text()) == (batch_size > 1)
    checkpoints = sorted(workdir.glob("md.chk_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    assert len(checkpoints) == STEPS + 1, sorted(p.name for p in workdir.iterdir())
    return [bead_positions(p) for p in checkpoints], np.loadtxt(workdir / "md.out", ndmin=2)


def bead_positions(checkpoint: Path) -> np.ndarray:
    """The ring polymer's positions (bohr), as i-PI wrote them (repr of each float)."""
    text = checkpoint.read_text()
    beads = re.search(r"<beads[^>]*>(.*?)</beads>", text, re.S)
    assert beads is not None, text[:2000]
    q = re.search(r"<q shape='\((\d+), *(\d+)\)'>\s*\[(.*?)\]\s*</q>", beads.group(1), re.S)
    assert q is not None, beads.group(1)[:2000]
    values = np.array([float(v) for v in q.group(3).split(",")])
    return values.reshape(int(q.group(1)), int(q.group(2)))


def test_batched_pimd_follows_the_one_at_a_time_trajectory(fake_built_root, tmp_path):
    single, single_props = run_pimd(fake_built_root, tmp_path / "batch1", batch_size=1)
    # 4: one full batch per step; 3: a full batch and a padded one (i-PI repeats the
    # last structure), so both the layout and the padding are exercised.
    for batch_size in (BEADS, 3):
        batched, props = run_pimd(fake_built_root, tmp_path / f"batch{batch_size}", batch_size)
        assert batched[0].shape == (BEADS, 12)
        for step, (got, want) in enumerate(zip(batched, single, strict=True)):
            np.testing.assert_allclose(
                got, want, rtol=0, atol=1e-10, err_msg=f"batch_size {batch_size}, step {step}"
            )
        # Energies and virials came back per structure too: the printed potential and
        # pressure (from the virials) agree to their printed precision.
        np.testing.assert_allclose(props, single_props, rtol=1e-7, atol=1e-9)
    # The beads moved apart: the comparison is not of a trajectory standing still.
    assert np.ptp(single[-1], axis=0).max() > 1e-4
    assert np.ptp(single_props[:, 2]) > 0
