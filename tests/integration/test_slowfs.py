"""scripts/dev/slowfs-up: the slow shared filesystem that cold-start tests and benchmarks use.

A real FUSE mount (mfusepy on Debian's libfuse3). Timings are only ever lower bounds:
a loaded machine makes the mount slower, never faster.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UP = REPO / "scripts" / "dev" / "slowfs-up"
DOWN = REPO / "scripts" / "dev" / "slowfs-down"


def slowfs_up(source: Path, mount: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(UP), str(source), str(mount), *options],
        capture_output=True,
        text=True,
        timeout=300,
    )


def slowfs_down(mount: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(DOWN), str(mount)], capture_output=True, text=True, timeout=300)


def stats(mount: Path) -> dict:
    return json.loads((mount / ".slowfs-stats").read_text())


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    (source / "pkg" / "sub").mkdir(parents=True)
    for n in range(20):
        (source / "pkg" / f"mod{n}.py").write_text(f"value = {n}\n")
    (source / "pkg" / "sub" / "blob.bin").write_bytes(os.urandom(2_000_000))
    (source / "latest").symlink_to("pkg")
    return source


@pytest.fixture
def mounted(tree: Path, tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "mount"
    done = slowfs_up(tree, mount, "--latency-ms", "5", "--read-mbps", "10")
    assert done.returncode == 0, done.stderr
    try:
        yield mount
    finally:
        if slowfs_down(mount).returncode != 0:
            subprocess.run(["fusermount3", "-uz", str(mount)], timeout=60)


def test_slowfs_serves_the_tree_read_only(tree: Path, mounted: Path):
    assert sorted(p.name for p in mounted.iterdir()) == ["latest", "pkg"]
    assert os.readlink(mounted / "latest") == "pkg"
    for n in range(20):
        assert (mounted / "latest" / f"mod{n}.py").read_text() == f"value = {n}\n"
    blob = (tree / "pkg" / "sub" / "blob.bin").read_bytes()
    assert (mounted / "pkg" / "sub" / "blob.bin").read_bytes() == blob
    with pytest.raises(OSError) as refused:
        (mounted / "pkg" / "new.py").write_text("x = 1\n")
    assert refused.value.errno == errno.EROFS
    assert not (tree / "pkg" / "new.py").exists()


def test_every_metadata_operation_waits_and_is_counted(mounted: Path):
    before = stats(mounted)
    started = time.monotonic()
    for n in range(20):
        os.stat(mounted / "pkg" / f"mod{n}.py")
    elapsed = time.monotonic() - started
    after = stats(mounted)
    # Nothing is cached by the kernel: each stat is at least one getattr, each 5 ms.
    getattrs = after["ops"]["getattr"] - before["ops"].get("getattr", 0)
    assert getattrs >= 20
    assert elapsed >= 20 * 0.005
    # A second pass is as cold as the first.
    for n in range(20):
        os.stat(mounted / "pkg" / f"mod{n}.py")
    again = stats(mounted)["ops"]["getattr"] - after["ops"]["getattr"]
    assert again >= 20
    assert after["metadata_ops"] > before["metadata_ops"]


def test_reads_are_paced_to_the_bandwidth_and_counted(mounted: Path):
    before = stats(mounted)["bytes_read"]
    started = time.monotonic()
    data = (mounted / "pkg" / "sub" / "blob.bin").read_bytes()
    elapsed = time.monotonic() - started
    assert len(data) == 2_000_000
    assert elapsed >= 2_000_000 / 10e6  # 10 MB/s
    assert stats(mounted)["bytes_read"] - before == 2_000_000
    # Read again: direct I/O, so the bytes cross the mount again.
    (mounted / "pkg" / "sub" / "blob.bin").read_bytes()
    assert stats(mounted)["bytes_read"] - before == 4_000_000


def test_readers_at_once_each_get_their_own_files(tree: Path, mounted: Path):
    def read(n: int) -> tuple[int, str]:
        return n, (mounted / "pkg" / f"mod{n}.py").read_text()

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(read, range(20)))
    assert results == [(n, f"value = {n}\n") for n in range(20)]
    code = "import sys; print(open(sys.argv[1], 'rb').read() == open(sys.argv[2], 'rb').read())"
    procs = [
        subprocess.Popen(
            [
                "python3",
                "-c",
                code,
                str(mounted / "pkg" / "sub" / "blob.bin"),
                str(tree / "pkg" / "sub" / "blob.bin"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert out.strip() == "True"


def test_down_refuses_a_busy_mount_then_unmounts_and_ends_the_process(mounted: Path):
    pid = stats(mounted)["pid"]
    holder = open(mounted / "pkg" / "mod0.py")  # noqa: SIM115 - held open on purpose
    try:
        busy = slowfs_down(mounted)
        assert busy.returncode != 0
        assert "busy" in busy.stderr and "fusermount3 -uz" in busy.stderr
        assert os.path.ismount(mounted)
    finally:
        holder.close()
    done = slowfs_down(mounted)
    assert done.returncode == 0, done.stderr
    assert not os.path.ismount(mounted)
    assert not Path(f"/proc/{pid}").exists()
    # A second down is harmless.
    assert slowfs_down(mounted).returncode == 0


def test_up_names_the_fix_for_a_missing_source_or_a_mount_in_use(
    tree: Path, mounted: Path, tmp_path: Path
):
    missing = slowfs_up(tmp_path / "nope", tmp_path / "m2")
    assert missing.returncode != 0
    assert "is not a directory" in missing.stderr
    again = slowfs_up(tree, mounted)
    assert again.returncode != 0
    assert f"scripts/dev/slowfs-down {mounted}" in again.stderr
    assert "Traceback" not in missing.stderr + again.stderr
