"""Files that are not regular files where rootstock reads: never a hang, always a fix.

A FIFO, a symbolic link or a directory in the pool directory, in a worker run
directory or where a worker's log or the user's token file is read from, is
reported with its path, what it is and the ``rm`` that clears it, and skipped (or
refused, where nothing can go on without it). Each test has a short deadline: on a
FIFO, the old code blocked in ``open()`` forever.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from rootstock.errors import RootstockError
from rootstock.install.parsing import NotRegularFile, open_regular_file
from rootstock.ops.workers import list_workers
from rootstock.runtime.pool.directory import (
    STATE_SCHEMA,
    PoolFiles,
    ensure_pool_dir,
    read_json,
    read_states,
    write_json_atomic,
)
from rootstock.runtime.server import OWNER_FILE, sweep_dead_run_dirs
from rootstock.runtime.spawn import WorkerProcess
from rootstock.runtime.worker_env import find_hf_token

pytestmark = pytest.mark.timeout(30)

DIGEST = "0123456789abcdef"
KINDS = ("fifo", "symlink", "directory")
WORDS = {"fifo": "a FIFO", "symlink": "a symbolic link", "directory": "a directory"}
FIX = {"fifo": "rm {}", "symlink": "rm {}", "directory": "rm -r {}"}


def plant(path: Path, kind: str) -> Path:
    """Put a ``kind`` (fifo, symlink, directory) at ``path``."""
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "symlink":
        target = path.with_name(f"{path.name}.target")
        target.write_text('{"schema": 1}')
        path.symlink_to(target)
    else:
        path.mkdir()
    return path


def private(tmp_path: Path) -> Path:
    directory = tmp_path / "pool"
    directory.mkdir(mode=0o700)
    return directory


@pytest.mark.parametrize("kind", KINDS)
def test_read_states_skips_and_reports_what_is_not_a_regular_file(tmp_path, caplog, kind):
    directory = private(tmp_path)
    planted = plant(directory / f"{DIGEST}.json", kind)
    good = {"schema": STATE_SCHEMA, "id": "f" * 16, "started": "2024-01-01T00:00:00Z"}
    write_json_atomic(directory / f"{'f' * 16}.json", good)
    with caplog.at_level(logging.WARNING):
        states = read_states(directory)
    assert states == [good]
    (message,) = [r.getMessage() for r in caplog.records if str(planted) in r.getMessage()]
    assert WORDS[kind] in message and FIX[kind].format(planted) in message


@pytest.mark.parametrize("kind", KINDS)
def test_the_error_file_is_read_only_if_it_is_a_regular_file(tmp_path, caplog, kind):
    files = PoolFiles(private(tmp_path), DIGEST)
    plant(files.error, kind)
    with caplog.at_level(logging.WARNING):
        assert read_json(files.error) is None
    assert any(FIX[kind].format(files.error) in r.getMessage() for r in caplog.records)


def test_a_directory_in_place_of_the_state_file_is_refused_with_the_fix(tmp_path):
    files = PoolFiles(private(tmp_path), DIGEST)
    files.state.mkdir()
    with pytest.raises(RootstockError) as info:
        files.remove_leftovers()
    assert str(files.state) in info.value.message and "a directory" in info.value.message
    assert info.value.hint and f"rm -r {files.state}" in info.value.hint


def test_the_opener_refuses_every_kind_but_a_regular_file(tmp_path):
    for kind in KINDS:
        path = plant(tmp_path / kind, kind)
        for flags in (os.O_RDONLY, os.O_RDWR | os.O_CREAT, os.O_WRONLY | os.O_APPEND):
            with pytest.raises(NotRegularFile) as info:
                os.close(open_regular_file(path, flags))
            assert WORDS[kind] in info.value.kind and info.value.fix == FIX[kind].format(path)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s"))
        with pytest.raises(NotRegularFile, match="a socket"):
            open_regular_file(tmp_path / "s")
    finally:
        sock.close()
    with pytest.raises(FileNotFoundError):
        open_regular_file(tmp_path / "missing")


def test_the_opener_follows_links_only_when_asked_and_leaves_blocking_mode(tmp_path):
    regular = tmp_path / "data"
    regular.write_bytes(b"x" * 100)
    link = tmp_path / "link"
    link.symlink_to(regular)
    fd = open_regular_file(link, follow_symlinks=True)
    try:
        assert os.read(fd, 200) == b"x" * 100 and os.get_blocking(fd)
    finally:
        os.close(fd)
    # A link to a FIFO is still a FIFO.
    fifo = plant(tmp_path / "fifo", "fifo")
    (tmp_path / "fifo-link").symlink_to(fifo)
    with pytest.raises(NotRegularFile, match="a FIFO"):
        open_regular_file(tmp_path / "fifo-link", follow_symlinks=True)
    fd = open_regular_file(tmp_path / "new.lock", os.O_RDWR | os.O_CREAT)
    os.close(fd)
    assert (tmp_path / "new.lock").is_file()
    # A dangling link is not followed into making a file elsewhere.
    (tmp_path / "dangling").symlink_to(tmp_path / "made-elsewhere")
    with pytest.raises(NotRegularFile, match="a symbolic link"):
        open_regular_file(tmp_path / "dangling", os.O_RDWR | os.O_CREAT)
    assert not (tmp_path / "made-elsewhere").exists()


def test_the_run_dir_sweep_does_not_hang_on_a_fifo_owner_record(tmp_path, caplog):
    run_dir = tmp_path / "rootstock-1-abcdefgh"
    run_dir.mkdir(mode=0o700)
    owner = plant(run_dir / OWNER_FILE, "fifo")
    with caplog.at_level(logging.WARNING):
        assert sweep_dead_run_dirs(tmp_path) == []
    assert run_dir.is_dir()  # no owner can be read: not judged, not removed
    assert any(f"rm {owner}" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ("fifo", "symlink"))
def test_a_worker_output_tail_says_what_its_log_is_instead_of_hanging(tmp_path, kind):
    log = plant(tmp_path / "worker.log", kind)
    process = WorkerProcess(popen=None, output="capture", log_path=log)  # type: ignore[arg-type]
    tail = process.output_tail()
    assert str(log) in tail and WORDS[kind] in tail and FIX[kind].format(log) in tail
    # A log the user named (ROOTSTOCK_WORKER_LOG) may be a link: that one is followed.
    real = tmp_path / "real.log"
    real.write_text("first\nsecond\n")
    (tmp_path / "named.log").symlink_to(real)
    named = WorkerProcess(popen=None, output=str(tmp_path / "named.log"),  # type: ignore[arg-type]
                          log_path=tmp_path / "named.log", log_offset=6)  # fmt: skip
    assert named.output_tail() == "second"


def test_a_fifo_in_place_of_the_token_file_is_skipped(tmp_path, caplog):
    plant(tmp_path / ".hf_token", "fifo")
    token_dir = tmp_path / ".cache" / "huggingface"
    token_dir.mkdir(parents=True)
    (token_dir / "token").write_text("hf_second\n")
    with caplog.at_level(logging.WARNING):
        assert find_hf_token({}, tmp_path) == ("hf_second", str(token_dir / "token"))
    assert any(f"rm {tmp_path / '.hf_token'}" in r.getMessage() for r in caplog.records)


def test_workers_list_reports_a_lock_in_the_way_of_a_clean_up_and_goes_on(monkeypatch, caplog):
    runtime = Path(tempfile.mkdtemp(prefix="rs-unit-", dir="/tmp"))  # short: sockets fit
    try:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
        directory = ensure_pool_dir()
        files = PoolFiles(directory, DIGEST)
        gone = {"host": socket.gethostname(), "pid": 1 << 30, "started": None, "boot": None}
        state = {"schema": STATE_SCHEMA, "id": DIGEST, "daemon": gone, "started": "x"}
        write_json_atomic(files.state, state)
        files.lock.mkdir()
        with caplog.at_level(logging.WARNING):
            assert list_workers() == []
        (message,) = [r.getMessage() for r in caplog.records if str(files.lock) in r.getMessage()]
        assert "a directory" in message and f"rm -r {files.lock}" in message
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
