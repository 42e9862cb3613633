"""Images of each build (issue 30, part 3): ``install --image`` packs the venv into a
squashfs inside its generation, records it, and treats it as part of the generation.

Real uv builds and real ``mksquashfs``/``unsquashfs``; EMT.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from rootstock.install.images import IMAGE_NAME, file_sha256
from rootstock.install.manifest import MANIFEST_VERSION
from tests.conftest import ROOTSTOCK, run_rootstock
from tests.integration.images import DEADLINE_S, SAMPLE_EMT
from tests.integration.pooling import wait_for

pytestmark = pytest.mark.timeout(900)


def _generation(root: Path) -> Path:
    return Path(os.path.realpath(root / "envs" / "emt"))


def _listing(image: Path) -> list[str]:
    done = subprocess.run(
        ["unsquashfs", "-l", "-d", "", str(image)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [line.lstrip("/") for line in done.stdout.splitlines()]


def test_install_packs_an_image_into_the_generation_and_records_it(image_root):
    generation = _generation(image_root)
    image = generation / IMAGE_NAME
    record = json.loads((generation / "rootstock-env.json").read_text())["image"]
    assert record == {
        "file": IMAGE_NAME,
        "sha256": file_sha256(image),
        "size": image.stat().st_size,
        "compression": "zstd-3",
    }
    manifest = json.loads((image_root / "manifest.json").read_text())
    assert manifest["schema_version"] == MANIFEST_VERSION
    assert manifest["envs"]["emt"]["image"] == record
    assert stat.S_IMODE(image.stat().st_mode) & 0o444 == 0o444  # world-readable
    listed = set(_listing(image))
    assert {"bin/python", "pyvenv.cfg", "lib"} <= listed
    assert any(p.endswith("site-packages/ase/calculators/emt.py") for p in listed)
    # What every spawn reads from the shared generation stays out of it.
    for left_out in ("env_source.py", "rootstock-env.json", ".rootstock-generation.lock"):
        assert left_out not in listed


def test_no_image_and_the_root_setting_build_as_before(scratch_root, monkeypatch):
    monkeypatch.delenv("ROOTSTOCK_IMAGES", raising=False)
    run_rootstock("install", SAMPLE_EMT, "--root", scratch_root, "--no-image", "--no-push")
    generation = _generation(scratch_root)
    assert not (generation / IMAGE_NAME).exists()
    assert json.loads((generation / "rootstock-env.json").read_text())["image"] is None
    manifest = json.loads((scratch_root / "manifest.json").read_text())
    assert manifest["envs"]["emt"]["image"] is None
    # The root's own setting: init --no-images, kept by a later install.
    config = {"ROOTSTOCK_CONFIG": str(scratch_root.parent / "c.toml")}
    run_rootstock("init", "--root", scratch_root, "--force", "--no-images", "--yes", env=config)
    assert json.loads((scratch_root / "layout.json").read_text())["images"] is False
    run_rootstock("install", "emt", "--root", scratch_root, "--force", "--no-push")
    assert not (_generation(scratch_root) / IMAGE_NAME).exists()
    # --image wins over the root's setting; the old generation keeps what it had.
    run_rootstock("install", "emt", "--root", scratch_root, "--force", "--image", "--no-push")
    assert (_generation(scratch_root) / IMAGE_NAME).is_file()


def test_a_rebuild_deletes_an_image_only_with_its_generation(own_image_root):
    first = _generation(own_image_root)
    run_rootstock("install", "emt", "--root", own_image_root, "--force", "--image", "--no-push")
    second = _generation(own_image_root)
    assert (first / IMAGE_NAME).is_file()  # the replaced build is kept one generation
    run_rootstock("install", "emt", "--root", own_image_root, "--force", "--image", "--no-push")
    assert not first.exists()
    assert (second / IMAGE_NAME).is_file() and (_generation(own_image_root) / IMAGE_NAME).is_file()
    images = sorted(p.parent.name for p in (own_image_root / "envs").glob(f".*/{IMAGE_NAME}"))
    assert images == sorted([second.name, _generation(own_image_root).name])


def test_an_install_killed_while_packing_leaves_no_image(scratch_root, monkeypatch):
    monkeypatch.setenv("ROOTSTOCK_IMAGES", "1")
    install = subprocess.Popen(
        [*ROOTSTOCK, "install", str(SAMPLE_EMT), "--root", str(scratch_root), "--no-push"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = []
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            line = install.stderr.readline()
            seen.append(line)
            if "packing the image" in line or not line:
                break
        assert "packing the image" in seen[-1], "".join(seen)
        os.kill(install.pid, signal.SIGKILL)
    finally:
        install.kill()
        install.wait(timeout=60)
    # mksquashfs, orphaned, may still finish its file in the build's work directory.
    wait_for(lambda: "mksquashfs" not in _processes(), DEADLINE_S, "mksquashfs to end")
    assert not (scratch_root / "envs" / "emt").exists()
    assert not list((scratch_root / "envs").glob(f"*/{IMAGE_NAME}"))
    # The next install sweeps the killed build's staging, image and all, then builds.
    run_rootstock("install", SAMPLE_EMT, "--root", scratch_root, "--no-push")
    assert (_generation(scratch_root) / IMAGE_NAME).is_file()
    assert not list((scratch_root / ".build").rglob(IMAGE_NAME))


def _processes() -> str:
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_check_perms_and_the_audit_script_flag_an_image_others_cannot_read(own_image_root):
    image = _generation(own_image_root) / IMAGE_NAME
    image.chmod(0o600)
    done = run_rootstock("check-perms", own_image_root, "--json", check=False)
    assert done.returncode == 1
    assert str(image) in done.stdout or IMAGE_NAME in done.stdout, done.stdout
    audit = subprocess.run(
        [
            "bash",
            str(Path(__file__).resolve().parents[2] / "scripts" / "check_world_readable.sh"),
            str(own_image_root),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert audit.returncode == 1
    assert IMAGE_NAME in audit.stdout
