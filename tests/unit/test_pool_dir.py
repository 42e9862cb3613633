"""The pool directory's rules, the relay's frame reader and the workers id selection."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

from rootstock.errors import ProtocolError, RootstockError, UsageError
from rootstock.ops.workers import PooledWorker, select_workers
from rootstock.runtime.pool.directory import (
    POOL_DIR_NAME,
    PoolFiles,
    check_private_dir,
    ensure_pool_dir,
    fallback_pool_dir,
    pool_dir_path,
    read_states,
    write_json_atomic,
)
from rootstock.runtime.pool.relay import (
    BATCH,
    BATCHREADY,
    ReplyBound,
    read_client_frame,
    read_worker_reply,
)
from rootstock.wire.framing import (
    GETFORCE,
    FrameStream,
    encode_error,
    encode_forceready,
    encode_init,
    encode_posdata,
)


def test_xdg_runtime_dir_holds_the_pool_dir(short_tmp_path):
    assert pool_dir_path({"XDG_RUNTIME_DIR": str(short_tmp_path)}) == short_tmp_path / POOL_DIR_NAME


def test_without_xdg_runtime_dir_the_pool_dir_is_named_by_uid(tmp_path):
    assert pool_dir_path({}) == fallback_pool_dir() == fallback_pool_dir(os.getuid())
    assert str(fallback_pool_dir(1234)) == "/tmp/rootstock-1234"
    # A runtime dir that does not exist, or whose socket paths would not fit, is not used.
    assert pool_dir_path({"XDG_RUNTIME_DIR": str(tmp_path / "missing")}) == fallback_pool_dir()
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    assert pool_dir_path({"XDG_RUNTIME_DIR": str(deep)}) == fallback_pool_dir()


def test_the_pool_dir_is_made_private_whatever_the_umask(short_tmp_path):
    old = os.umask(0o000)
    try:
        made = ensure_pool_dir({"XDG_RUNTIME_DIR": str(short_tmp_path)})
    finally:
        os.umask(old)
    assert made == short_tmp_path / POOL_DIR_NAME
    assert os.stat(made).st_mode & 0o777 == 0o700
    assert ensure_pool_dir({"XDG_RUNTIME_DIR": str(short_tmp_path)}) == made  # existing: fine


def test_a_pool_dir_with_the_wrong_mode_is_refused_and_left_alone(short_tmp_path):
    path = short_tmp_path / POOL_DIR_NAME
    path.mkdir()
    path.chmod(0o750)
    with pytest.raises(RootstockError, match="mode 0750, not 0700") as info:
        ensure_pool_dir({"XDG_RUNTIME_DIR": str(short_tmp_path)})
    assert info.value.hint is not None and f"chmod 700 {path}" in info.value.hint
    assert os.stat(path).st_mode & 0o777 == 0o750  # never changed for the user


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_a_pool_dir_owned_by_someone_else_is_refused(tmp_path):
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, 12345, 12345)
    with pytest.raises(RootstockError, match="belongs to uid 12345, not to you"):
        check_private_dir(path)


def test_a_symlinked_pool_dir_is_refused_even_to_a_private_dir(short_tmp_path):
    target = short_tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (short_tmp_path / POOL_DIR_NAME).symlink_to(target)
    with pytest.raises(RootstockError, match="symbolic link"):
        ensure_pool_dir({"XDG_RUNTIME_DIR": str(short_tmp_path)})


def test_a_file_in_the_way_is_refused(short_tmp_path):
    (short_tmp_path / POOL_DIR_NAME).write_text("")
    with pytest.raises(RootstockError, match="not a directory"):
        ensure_pool_dir({"XDG_RUNTIME_DIR": str(short_tmp_path)})


def test_state_files_are_read_back_and_others_skipped(tmp_path):
    files = PoolFiles(tmp_path, "0123456789abcdef")
    assert files.socket.name == "0123456789abcdef.sock"
    write_json_atomic(files.state, {"schema": 1, "id": files.digest, "started": "b"})
    write_json_atomic(tmp_path / "old.json", {"schema": 1, "id": "old", "started": "a"})
    write_json_atomic(files.error, {"schema": 1, "id": "not a state"})
    write_json_atomic(tmp_path / "future.json", {"schema": 99, "id": "future"})
    (tmp_path / "garbage.json").write_text("{not json")
    assert [s["id"] for s in read_states(tmp_path)] == ["old", files.digest]
    assert os.stat(files.state).st_mode & 0o777 == 0o600
    files.remove_leftovers()
    assert not files.state.exists() and not files.error.exists()


def _stream_with(data: bytes) -> tuple[FrameStream, socket.socket]:
    ours, theirs = socket.socketpair()
    theirs.sendall(data)
    theirs.shutdown(socket.SHUT_WR)
    return FrameStream(ours, peer="test"), theirs


def test_the_relay_reads_whole_frames_byte_for_byte():
    init = encode_init({"numbers": [29, 29], "pbc": [True] * 3})
    posdata = encode_posdata(np.eye(3) * 3.6, np.zeros((2, 3)))
    batch = BATCH + (5).to_bytes(4, "little") + b"hello"
    stream, peer = _stream_with(init + posdata + GETFORCE + batch)
    frames = [read_client_frame(stream) for _ in range(4)]
    assert [f.data for f in frames] == [init, posdata, GETFORCE, batch]
    assert [f.word for f in frames] == ["INIT", "POSDATA", "GETFORCE", "BATCH"]
    peer.close()

    reply = encode_forceready(-1.5, np.ones((2, 3)), np.eye(3), b'{"model": {}}')
    error = encode_error("ValueError", "bad", "tb", "calculate")
    ready = BATCHREADY + (3).to_bytes(4, "little") + b"abc"
    stream, peer = _stream_with(reply + error + ready)
    bounds = [ReplyBound(natoms=2), ReplyBound(natoms=2), ReplyBound(items=1, atoms=2)]
    assert [read_worker_reply(stream, bound).data for bound in bounds] == [reply, error, ready]
    peer.close()


def test_the_relay_refuses_a_reply_that_does_not_fit_its_request():
    reply = encode_forceready(-1.5, np.ones((2, 3)), np.eye(3), b"{}")
    ready = BATCHREADY + (3).to_bytes(4, "little") + b"abc"
    for data, bound, words in [
        (reply, ReplyBound(natoms=3), "declares 2 atoms, but the request had 3"),
        (reply, ReplyBound(items=1, atoms=2), "answered a BATCH with FORCEREADY"),
        (ready, ReplyBound(natoms=2), "answered GETFORCE with BATCHREADY"),
    ]:
        stream, peer = _stream_with(data)
        with pytest.raises(ProtocolError, match=words):
            read_worker_reply(stream, bound)
        peer.close()


def test_the_relay_refuses_frames_a_client_may_not_send_and_bad_lengths():
    stream, peer = _stream_with(encode_forceready(0.0, np.zeros((1, 3)), np.eye(3)))
    with pytest.raises(ProtocolError, match="does not relay"):
        read_client_frame(stream)
    peer.close()
    stream, peer = _stream_with(BATCH + (-4).to_bytes(4, "little", signed=True))
    with pytest.raises(ProtocolError, match="declares -4 bytes"):
        read_client_frame(stream)
    peer.close()


def _worker(id_: str) -> PooledWorker:
    return PooledWorker(id_, "emt", "emt", "cpu", "/r", 1, 2, 0, "t", 600.0, False, "s", "l")


def test_ids_are_selected_by_unique_prefix_and_unknown_ones_list_the_known():
    workers = [_worker("abc123"), _worker("abd456"), _worker("ffff00")]
    assert select_workers(["ff"], workers) == [workers[2]]
    assert select_workers(["abc123", "abc"], workers) == [workers[0]]
    with pytest.raises(UsageError, match="matches several"):
        select_workers(["ab"], workers)
    with pytest.raises(UsageError, match="known ids: abc123, abd456, ffff00"):
        select_workers(["0000"], workers)
    with pytest.raises(UsageError, match="none are running"):
        select_workers(["0000"], [])


def test_the_daemon_gets_back_the_spec_it_was_started_for(tmp_path):
    from rootstock.install.layout import InstallLayout
    from rootstock.runtime.spec import WorkerSpec

    spec = WorkerSpec(
        layout=InstallLayout(root=tmp_path / "root", cache_root=tmp_path / "cache"),
        checkpoint="mace:custom",
        env_name="mace",
        device="cuda:1",
        setup_kwargs={"head": "omat", "scale": [1.0, float("nan")]},
        weights=tmp_path / "w.model",
        cluster="perlmutter",
    )
    back = WorkerSpec.from_json(spec.to_json())
    assert back.layout == spec.layout and back.weights == spec.weights
    assert (back.checkpoint, back.env_name, back.device, back.cluster) == (
        "mace:custom",
        "mace",
        "cuda:1",
        "perlmutter",
    )
    assert back.setup_kwargs["head"] == "omat" and np.isnan(back.setup_kwargs["scale"][1])
