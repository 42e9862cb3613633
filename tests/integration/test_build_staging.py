"""Build staging after a crash: no process of a killed install lives on, and the next
install sweeps what it left in ``{root}/.build/``, but never a live build's staging.

The kill test SIGKILLs a real ``rootstock install --force`` of the EMT env while uv
is installing packages, and tracks every process the install started (uv, its
children, the supervisors) by a marker variable in their environment, which each
inherits whatever its parent was.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from rootstock.install.build import FOREIGN_BUILD_STALE_S, OWNER_SUFFIX, SWEPT_PREFIX
from rootstock.install.layout import InstallLayout
from rootstock.install.supervise import process_start_time
from rootstock.ops.install import sweep_stale_staging
from tests.conftest import ROOTSTOCK, run_rootstock

pytestmark = pytest.mark.timeout(600)

MARKER = "ROOTSTOCK_TEST_BUILD_MARKER"


def marked_processes(marker: str) -> dict[int, list[str]]:
    """Running (non-zombie) processes whose environment carries ``MARKER=marker``."""
    wanted = f"{MARKER}={marker}".encode()
    found: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if wanted not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            stat = (entry / "stat").read_bytes()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if stat[stat.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X"):
            found[int(entry.name)] = argv
    return found


def kill_marked(marker: str) -> None:
    for pid in marked_processes(marker):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def installing_packages(argv: list[str]) -> bool:
    """uv itself (not its supervisor) in the long ``pip install --compile-bytecode`` step."""
    return Path(argv[0]).name == "uv" and "--compile-bytecode" in argv


def test_killed_install_leaves_no_process_and_the_next_install_sweeps(
    own_root: Path, tmp_path: Path
):
    marker = uuid.uuid4().hex
    log = (tmp_path / "install.log").open("w+")
    install = subprocess.Popen(
        [*ROOTSTOCK, "install", "emt", "--force", "--root", str(own_root), "--no-push"],
        env={**os.environ, MARKER: marker},
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not any(map(installing_packages, marked_processes(marker).values())):
            if install.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"never saw uv installing packages:\n{log.read()}")
            time.sleep(0.01)
        os.kill(install.pid, signal.SIGKILL)  # the install alone, as a crash would
        install.wait(timeout=10)
        killed_at = time.monotonic()
        while (alive := marked_processes(marker)) and time.monotonic() - killed_at < 5:
            time.sleep(0.05)
        assert alive == {}, f"still running 5 s after the install was killed: {alive}"
    finally:
        kill_marked(marker)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(install.pid, signal.SIGKILL)
        install.wait(timeout=10)
        log.close()
    left = sorted(p.name for p in (own_root / ".build").iterdir())
    assert any(name.endswith(OWNER_SUFFIX) for name in left), left  # the crash's staging
    # What a kill between activate()'s symlink and its replace would leave.
    dangling = own_root / "envs" / ".emt.link-0badf00d"
    dangling.symlink_to(".emt.gone")

    run_rootstock("install", "emt", "--force", "--root", own_root, "--no-push", timeout=600)
    assert sorted(p.name for p in (own_root / ".build").iterdir()) == []
    assert not dangling.is_symlink()
    subprocess.run(
        [own_root / "envs" / "emt" / "bin" / "python", "-c", "import ase"], check=True, timeout=60
    )


def _plant(build_dir: Path, base: str, owner: dict | None, age_s: float = 0.0) -> list[Path]:
    """A staging venv, its work dir and (optionally) its owner record, ``age_s`` old."""
    paths = [build_dir / base, build_dir / f"{base}.work"]
    for path in paths:
        (path / "lib").mkdir(parents=True)
        (path / "lib" / "payload").write_text("x")
    if owner is not None:
        paths.append(build_dir / f"{base}{OWNER_SUFFIX}")
        paths[-1].write_text(json.dumps(owner))
    stamp = time.time() - age_s
    for path in paths:
        os.utime(path, (stamp, stamp))
    return paths


def _owner(host: str, pid: int, pid_start: str | None = None) -> dict:
    return {"env": "emt", "host": host, "pid": pid, "pid_start": pid_start}


def test_sweep_keeps_live_and_foreign_builds_and_removes_dead_ones(scratch_root: Path):
    build_dir = scratch_root / ".build"
    build_dir.mkdir()
    here = socket.gethostname()
    old = FOREIGN_BUILD_STALE_S + 3600
    sleeper = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL)
    finished = subprocess.Popen(["true"], stdin=subprocess.DEVNULL)
    finished.wait(timeout=10)
    try:
        live_start = process_start_time(sleeper.pid)
        keep = [
            # A live build on this host, however old its record.
            *_plant(build_dir, "emt.1-live", _owner(here, sleeper.pid, live_start), age_s=old),
            # Another host's build: its pid means nothing here; recent, so kept.
            *_plant(build_dir, "emt.2-remote", _owner("other-node.invalid", finished.pid)),
            # No owner record (an older client's build): kept while recent.
            *_plant(build_dir, "emt.3-legacy", None),
        ]
        gone = [
            *_plant(build_dir, "emt.4-dead", _owner(here, finished.pid)),
            # The pid is alive but is another process now (its start time differs).
            *_plant(build_dir, "emt.5-reused", _owner(here, sleeper.pid, "1")),
            *_plant(build_dir, "emt.6-remote-old", _owner("other-node.invalid", 1), age_s=old),
            *_plant(build_dir, "emt.7-legacy-old", None, age_s=old),
        ]
        # A kill during an owner record's atomic write leaves only its temp file.
        gone.append(build_dir / f".emt.8-cut{OWNER_SUFFIX}.tmp-{finished.pid}-0a1b2c3d")
        gone[-1].write_text('{"env": "em')
        (build_dir / f"{SWEPT_PREFIX}0a1b2c3d-emt.0-interrupted").mkdir()

        swept = sweep_stale_staging(InstallLayout(scratch_root, scratch_root))

        assert sorted(p.name for p in build_dir.iterdir()) == sorted(p.name for p in keep)
        assert len(swept) == len(gone) + 1
        assert all(not p.exists() for p in gone)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
