"""Workers started from a node-local stage of their build's image (issue 30, part 4).

Real ``install --image`` builds, real ``mksquashfs``, ``squashfuse`` and ``unsquashfs``,
real FUSE mounts; EMT for speed. Each test has its own ``$ROOTSTOCK_STAGE_DIR``
(:func:`tests.integration.images.stage_dir`), which its teardown unmounts and deletes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rootstock import RootstockCalculator
from rootstock.install.generations import claim_generation
from rootstock.runtime.stage_dir import MOUNT_DIR, TREE_DIR
from tests.conftest import run_rootstock
from tests.integration.images import DEADLINE_S, cu_cell, stage_entries, worker_argv0
from tests.integration.pooling import wait_for
from tests.integration.structures import emt_energy
from tests.leftovers import mounts_below

pytestmark = pytest.mark.timeout(600)


def _energy(root: Path, seed: int, **kw: object) -> tuple[float, str | None, int]:
    atoms = cu_cell(seed)
    with RootstockCalculator("emt", root=root, device="cpu", shared=False, **kw) as calc:
        atoms.calc = calc
        energy = float(atoms.get_potential_energy())
        return energy, calc.staged, calc.worker_pid or 0


@pytest.mark.parametrize("mode", ["mount", "copy"])
def test_a_staged_worker_computes_what_the_shared_env_computes(image_root, stage_dir, mode):
    atoms = cu_cell(seed=3)
    with RootstockCalculator("emt", root=image_root, device="cpu", stage=mode) as calc:
        atoms.calc = calc
        staged = atoms.get_potential_energy()
        assert calc.staged == mode
        argv0 = worker_argv0(calc.worker_pid)
        (entry,) = stage_entries(stage_dir)
        where = entry / (MOUNT_DIR if mode == "mount" else TREE_DIR)
        assert argv0 == str(where / "bin" / "python"), argv0
        # The worker holds the shared generation it was staged from, not the stage.
        generation = Path(os.path.realpath(image_root / "envs" / "emt"))
        with claim_generation(generation) as claimed:
            assert claimed is False
    unstaged, how, _ = _energy(image_root, seed=3, stage="off")
    assert how is None
    assert staged == pytest.approx(unstaged, abs=1e-12)
    assert staged == pytest.approx(emt_energy(atoms), abs=1e-12)


def test_stage_off_and_a_root_without_images_start_from_the_shared_env(
    image_root, emt_root, stage_dir, caplog
):
    caplog.set_level(logging.WARNING, logger="rootstock")
    energy, how, _ = _energy(image_root, seed=4, stage="off")
    assert how is None
    assert energy == pytest.approx(emt_energy(cu_cell(4)), abs=1e-12)
    # The emt_root's builds have no image ($ROOTSTOCK_IMAGES=0): auto says nothing.
    energy, how, _ = _energy(emt_root, seed=5)
    assert how is None
    assert energy == pytest.approx(emt_energy(cu_cell(5)), abs=1e-12)
    assert not stage_entries(stage_dir)
    assert not (stage_dir / f".rootstock-stage-{os.getuid()}").exists()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_mount_outlives_its_last_user_by_the_idle_timeout_even_after_sigkill(
    image_root, stage_dir
):
    script = textwrap.dedent(
        f"""
        import sys
        from rootstock import RootstockCalculator
        from tests.integration.images import cu_cell
        atoms = cu_cell(7)
        atoms.calc = RootstockCalculator("emt", root={str(image_root)!r}, device="cpu",
                                         stage="mount")
        print(atoms.get_potential_energy(), atoms.calc.staged, flush=True)
        sys.stdin.read()
        """
    )
    user = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[2],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = user.stdout.readline()
        assert line.split()[1] == "mount", line
        assert mounts_below([stage_dir])
        time.sleep(2)  # over the idle timeout: still mounted, it is in use
        assert mounts_below([stage_dir])
        os.kill(user.pid, signal.SIGKILL)
    finally:
        user.kill()
        user.wait(timeout=60)
    wait_for(lambda: not mounts_below([stage_dir]), DEADLINE_S, "the idle mount to be unmounted")
    (entry,) = stage_entries(stage_dir)
    wait_for(lambda: not (entry / "keeper.json").exists(), DEADLINE_S, "the keeper to exit")


@pytest.mark.parametrize("mode", ["copy", "mount"])
def test_two_workers_starting_at_once_on_a_node_stage_once(image_root, stage_dir, tmp_path, mode):
    go = tmp_path / "go"
    script = textwrap.dedent(
        f"""
        import logging, os, sys, time
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        from rootstock import RootstockCalculator
        from tests.integration.images import cu_cell
        seed = int(sys.argv[1])
        while not os.path.exists({str(go)!r}):
            time.sleep(0.001)
        atoms = cu_cell(seed)
        atoms.calc = RootstockCalculator("emt", root={str(image_root)!r}, device="cpu",
                                         stage={mode!r}, shared=False)
        energy = atoms.get_potential_energy()
        argv0 = open(f"/proc/{{atoms.calc.worker_pid}}/cmdline", "rb").read().split(b"\\0")[0]
        print(seed, energy, atoms.calc.staged, argv0.decode(), flush=True)
        time.sleep(float(sys.argv[2]))  # the two workers overlap
        atoms.calc.close()
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(seed), "2"],
            cwd=Path(__file__).resolve().parents[2],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (11, 12)
    ]
    go.touch()
    outputs = [p.communicate(timeout=DEADLINE_S * 3) for p in procs]
    copies = 0
    pythons = set()
    for (out, err), proc in zip(outputs, procs, strict=True):
        assert proc.returncode == 0, err
        seed, energy, how, python = out.split()
        pythons.add(python)
        assert how == mode
        assert float(energy) == pytest.approx(emt_energy(cu_cell(int(seed))), abs=1e-12)
        copies += err.count("copying its")
    assert copies == 1, [err for _, err in outputs]
    (entry,) = stage_entries(stage_dir)
    # Both ran from the one stage: for mount, the one mount point of the entry.
    assert pythons == {str(entry / (MOUNT_DIR if mode == "mount" else TREE_DIR) / "bin" / "python")}


def test_a_tampered_image_is_refused_and_the_worker_runs_from_the_shared_env(
    own_image_root, stage_dir, caplog
):
    image = Path(os.path.realpath(own_image_root / "envs" / "emt")) / ".rootstock-image.sqfs"
    with image.open("r+b") as fh:  # same size, one byte changed
        fh.seek(image.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    caplog.set_level(logging.WARNING, logger="rootstock")
    for mode in ("auto", "copy"):
        energy, how, _ = _energy(own_image_root, seed=8, stage=mode)
        assert how is None
        assert energy == pytest.approx(emt_energy(cu_cell(8)), abs=1e-12)
    assert "does not match the sha256 its build recorded" in caplog.text
    assert "starting from the shared env" in caplog.text
    entries = stage_entries(stage_dir)
    assert all(not (e / "image.sqfs").exists() and not (e / TREE_DIR).exists() for e in entries)
    assert not any(p.name.startswith("image.sqfs.part") for e in entries for p in e.iterdir())
    done = run_rootstock("stage", "emt", "--root", own_image_root, "--mode", "copy", check=False)
    assert done.returncode == 1
    assert "does not match the sha256" in done.stderr and "rootstock install emt" in done.stderr


@pytest.mark.parametrize("fault", ["mode", "symlink", "owner"])
def test_a_stage_directory_with_a_wrong_owner_or_mode_is_refused(
    image_root, stage_dir, tmp_path, caplog, fault
):
    if fault == "owner" and os.getuid() != 0:
        pytest.skip("only root can make a directory another user owns")  # CI runs as root
    root = stage_dir / f".rootstock-stage-{os.getuid()}"
    if fault == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "elsewhere")
    else:
        root.mkdir(mode=0o700)
        if fault == "mode":
            root.chmod(0o755)
        else:
            os.chown(root, 65534, 65534)
    caplog.set_level(logging.WARNING, logger="rootstock")
    energy, how, _ = _energy(image_root, seed=9, stage="copy")
    assert how is None
    assert energy == pytest.approx(emt_energy(cu_cell(9)), abs=1e-12)
    assert f"refusing the stage directory {root}" in caplog.text
    assert "ROOTSTOCK_STAGE_DIR" in caplog.text
    assert not any((tmp_path / "elsewhere").glob("*")) if fault == "symlink" else True
    assert not list(root.iterdir()) if fault != "symlink" else True


def test_a_sigkill_while_staging_leaves_nothing_a_later_worker_uses(
    image_root, stage_dir, tmp_path
):
    from tests.integration.test_slowfs import slowfs_down, slowfs_up

    slow = tmp_path / "slow"
    # 20 MB/s: the 100 MB image takes seconds to copy, time to kill the copy midway.
    assert slowfs_up(image_root, slow, "--latency-ms", "0", "--read-mbps", "20").returncode == 0
    try:
        env = {**os.environ, "ROOTSTOCK_STAGE": "copy"}
        stager = subprocess.Popen(
            [sys.executable, "-m", "rootstock.cli.main", "stage", "emt", "--root", str(slow)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for(
                lambda: any(
                    p.name.startswith("image.sqfs.part-") and p.stat().st_size > 0
                    for e in stage_entries(stage_dir)
                    for p in e.iterdir()
                ),
                DEADLINE_S,
                "the copy to start",
            )
            os.kill(stager.pid, signal.SIGKILL)
        finally:
            stager.kill()
            stager.wait(timeout=60)
        (entry,) = stage_entries(stage_dir)
        assert not (entry / "image.sqfs").exists() and not (entry / TREE_DIR).exists()
        # The next worker stages anew, removes what the killed one left, and computes.
        energy, how, _ = _energy(slow, seed=10, stage="copy")
        assert how == "copy"
        assert energy == pytest.approx(emt_energy(cu_cell(10)), abs=1e-12)
        assert [p.name for p in entry.iterdir() if ".part-" in p.name] == []
    finally:
        assert slowfs_down(slow).returncode == 0


def test_a_rebuild_stages_anew_and_the_old_stage_goes_once_unused(own_image_root, stage_dir):
    old_atoms = cu_cell(13)
    old = RootstockCalculator("emt", root=own_image_root, device="cpu", stage="mount")
    old_atoms.calc = old
    try:
        old_atoms.get_potential_energy()
        (old_entry,) = stage_entries(stage_dir)
        run_rootstock("install", "emt", "--root", own_image_root, "--force", "--image")
        energy, how, _ = _energy(own_image_root, seed=14, stage="mount")
        assert how == "mount"
        assert energy == pytest.approx(emt_energy(cu_cell(14)), abs=1e-12)
        entries = stage_entries(stage_dir)
        assert len(entries) == 2 and old_entry in entries  # the old one is in use
        assert old_atoms.get_potential_energy() == pytest.approx(emt_energy(old_atoms), abs=1e-12)
    finally:
        old.close()
    # The next stage on the node removes it: its build is no longer current, and unused.
    _energy(own_image_root, seed=15, stage="mount")
    assert old_entry not in stage_entries(stage_dir)
    assert str(old_entry / MOUNT_DIR) not in mounts_below([stage_dir])


def test_a_hotfix_of_env_source_applies_to_a_staged_worker(own_image_root, stage_dir):
    atoms = cu_cell(16)
    before, how, _ = _energy(own_image_root, seed=16, stage="copy")
    assert how == "copy"
    source = own_image_root / "envs" / "emt" / "env_source.py"
    text = source.read_text()
    assert "return EMT(**kw)" in text
    source.write_text(text.replace("return EMT(**kw)", "return EMT(asap_cutoff=True, **kw)"))
    after, how, _ = _energy(own_image_root, seed=16, stage="copy")
    assert how == "copy"
    assert after == pytest.approx(emt_energy(atoms, asap_cutoff=True), abs=1e-12)
    assert after != pytest.approx(before, abs=1e-6)


def test_stage_list_and_clean(image_root, stage_dir):
    done = run_rootstock("stage", "emt", "--root", image_root, "--mode", "copy", "--json")
    (outcome,) = json.loads(done.stdout)
    assert outcome["status"] == "staged" and outcome["mode"] == "copy"
    listed = json.loads(run_rootstock("stage", "--list", "--json").stdout)
    assert [(e["env"], e["extracted"], e["in_use"], e["current"]) for e in listed] == [
        ("emt", True, False, True)
    ]
    cleaned = json.loads(run_rootstock("stage", "--clean", "--json").stdout)
    assert cleaned == {"removed": [listed[0]["name"]], "kept_in_use": []}
    assert not (stage_dir / f".rootstock-stage-{os.getuid()}").exists()
    bad = run_rootstock("stage", "--root", image_root, check=False)
    assert bad.returncode == 2 and "--all" in bad.stderr
    unknown = run_rootstock("stage", "nosuch", "--root", image_root, check=False)
    assert unknown.returncode == 2 and "'nosuch' is neither an installed env" in unknown.stderr
    assert "Traceback" not in unknown.stderr
    # A stage directory others could write is refused by --list and --clean too.
    (stage_dir / f".rootstock-stage-{os.getuid()}").mkdir(mode=0o755)
    os.chmod(stage_dir / f".rootstock-stage-{os.getuid()}", 0o755)
    for flag in ("--list", "--clean"):
        refused = run_rootstock("stage", flag, check=False)
        assert refused.returncode == 1 and "its mode is 0755, not 0700" in refused.stderr


def test_verification_records_whether_its_worker_ran_staged(own_image_root, stage_dir):
    def staged_record(stage: str) -> object:
        run_rootstock(
            "add",
            "emt",
            "--root",
            own_image_root,
            "--device",
            "cpu",
            "--no-push",
            env={"ROOTSTOCK_STAGE": stage},
        )
        manifest = json.loads((own_image_root / "manifest.json").read_text())
        (by_kind,) = manifest["envs"]["emt"]["checkpoints"]["emt"]["verifications"].values()
        return by_kind["cpu"]["staged"]

    assert staged_record("copy") == "copy"
    assert staged_record("off") is None


def test_a_pooled_worker_stages_too(image_root, stage_dir, pool_dir):
    from tests.integration.pooling import pooled

    atoms = cu_cell(41)
    with pooled(image_root, stage="copy") as calc:
        atoms.calc = calc
        energy = atoms.get_potential_energy()
        argv0 = worker_argv0(calc.worker_pid)
    (entry,) = stage_entries(stage_dir)
    assert argv0 == str(entry / TREE_DIR / "bin" / "python")
    assert energy == pytest.approx(emt_energy(atoms), abs=1e-12)


def test_stage_all_stages_every_env_with_an_image(image_root, stage_dir):
    done = run_rootstock("stage", "--all", "--root", image_root, "--mode", "copy", "--json")
    assert [(o["env"], o["status"]) for o in json.loads(done.stdout)] == [("emt", "staged")]
