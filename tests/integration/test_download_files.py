"""``add`` records which files a download brought, in the checkpoint's ``files``.

Two routes, each proved on its own with real uv builds and real download workers:
the cache scan (files that appear or change under ``cache/`` and ``home/``) and the
paths the env's ``download()`` hook returns (a file, a directory, a symlink and its
target). An env whose worker predates the result file still fetches, recorded from
the scan alone. The pure attribution rules are checked in-process first.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from rootstock.install.layout import InstallLayout
from rootstock.ops.add import attributed_files, scan_cache
from rootstock.worker.main import returned_paths
from tests.conftest import make_root, run_rootstock
from tests.integration.checkpoint_envs import PLAIN_SETUP, install, reap_workers, write_env

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("private_config")]

# download() writes, for checkpoint C:
# * home/.cache/mylib/C.pt, never returned (only the scan can see it);
# * an HF-like hub: blobs/C-sha and blobs/config (the latter once, for the first id),
#   and snapshots/C/{model.bin, config.json} linking to them;
# * cache/shared/common.bin once, returned by every id (only the returned route sees
#   it for the second id);
# and returns, besides that file, what PRELOADED names (a directory the test put in
# the cache before the add), a path outside the cache root and two non-paths.
DOWNLOAD_HOOK = '''

PRELOADED = {preloaded!r}
OUTSIDE = {outside!r}


def download(checkpoint, **kw):
    """Fetch fake weights into the cache root the way model libraries do."""
    import os

    home, cache = os.environ["HOME"], os.environ["XDG_CACHE_HOME"]
    lib = os.path.join(home, ".cache", "mylib")
    os.makedirs(lib, exist_ok=True)
    with open(os.path.join(lib, checkpoint + ".pt"), "a") as fh:
        fh.write("weights of " + checkpoint + "\\n")
    hub = os.path.join(cache, "hub", "models--org--m")
    os.makedirs(os.path.join(hub, "blobs"), exist_ok=True)
    snapshot = os.path.join(hub, "snapshots", checkpoint)
    os.makedirs(snapshot, exist_ok=True)
    with open(os.path.join(hub, "blobs", checkpoint + "-sha"), "w") as fh:
        fh.write("model " + checkpoint)
    if not os.path.exists(os.path.join(hub, "blobs", "config")):
        with open(os.path.join(hub, "blobs", "config"), "w") as fh:
            fh.write("config")
    for name, blob in (("model.bin", checkpoint + "-sha"), ("config.json", "config")):
        link = os.path.join(snapshot, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", "..", "blobs", blob), link)
    shared = os.path.join(cache, "shared", "common.bin")
    if not os.path.exists(shared):
        os.makedirs(os.path.dirname(shared), exist_ok=True)
        with open(shared, "w") as fh:
            fh.write("common")
    returned = [shared, OUTSIDE, 42, None]
    if PRELOADED:
        returned.append(os.path.join(cache, PRELOADED))
    return returned
'''


def layout_of(root: Path) -> InstallLayout:
    return InstallLayout(root, root)


def files_of(root: Path, env: str, checkpoint: str) -> list[str] | None:
    data = json.loads((root / "manifest.json").read_text())
    return data["envs"][env]["checkpoints"][checkpoint].get("files")


def add_json(root: Path, checkpoint: str, *extra: str) -> dict:
    proc = run_rootstock(
        "add", checkpoint, "--no-verify", "--json", "--root", root, *extra, timeout=300
    )
    return json.loads(proc.stdout)


def hub(checkpoint: str) -> list[str]:
    """What the hub part of the hook brings for ``checkpoint`` (the config blob aside)."""
    base = "cache/hub/models--org--m"
    return [
        f"{base}/blobs/{checkpoint}-sha",
        f"{base}/snapshots/{checkpoint}/config.json",
        f"{base}/snapshots/{checkpoint}/model.bin",
    ]


@pytest.fixture
def root(tmp_path: Path, shared_uv_cache: Path):
    path = make_root(tmp_path / "root", shared_uv_cache)
    yield path
    reap_workers(path, grace_s=5)


def test_add_records_what_the_scan_and_the_hook_bring(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_text("not in the cache root")
    body = DOWNLOAD_HOOK.format(preloaded="preloaded", outside=str(outside)) + PLAIN_SETUP
    install(root, write_env(tmp_path / "src", "dl", ["dl-a", "dl-b"], body=body))
    # Already in the cache before any add: only the returned directory names these.
    preloaded = root / "cache" / "preloaded"
    (preloaded / "sub").mkdir(parents=True)
    (preloaded / "a.bin").write_text("a")
    (preloaded / "sub" / "b.bin").write_text("b")
    (root / "cache" / "unrelated.bin").write_text("an older download's")

    first = add_json(root, "dl-a")
    expected_a = sorted(
        [
            *hub("dl-a"),
            "cache/hub/models--org--m/blobs/config",
            "cache/preloaded/a.bin",
            "cache/preloaded/sub/b.bin",
            "cache/shared/common.bin",
            "home/.cache/mylib/dl-a.pt",
        ]
    )
    assert files_of(root, "dl", "dl-a") == expected_a
    assert first["downloaded"] is True and first["files"] == len(expected_a)

    second = add_json(root, "dl-b")
    # common.bin existed already: only the returned path attributes it; the config
    # blob existed already and was not returned: the new snapshot link brings it.
    expected_b = sorted(
        [
            *hub("dl-b"),
            "cache/hub/models--org--m/blobs/config",
            "cache/preloaded/a.bin",
            "cache/preloaded/sub/b.bin",
            "cache/shared/common.bin",
            "home/.cache/mylib/dl-b.pt",
        ]
    )
    assert files_of(root, "dl", "dl-b") == expected_b
    assert second["files"] == len(expected_b)
    # The first checkpoint's record is untouched by the second's download.
    assert files_of(root, "dl", "dl-a") == expected_a

    # A re-download keeps what still exists of the old list and adds the new.
    (preloaded / "a.bin").unlink()
    forced = add_json(root, "dl-a", "--force")
    again = files_of(root, "dl", "dl-a")
    assert again == [f for f in expected_a if f != "cache/preloaded/a.bin"]
    assert forced["files"] == len(again)
    # Without --force nothing is downloaded and the count is the record's.
    skipped = add_json(root, "dl-a")
    assert skipped["downloaded"] is False and skipped["files"] == len(again)


def test_an_older_worker_still_fetches_recorded_from_the_scan_alone(
    root: Path, tmp_path: Path
) -> None:
    body = DOWNLOAD_HOOK.format(preloaded="", outside="/nonexistent") + PLAIN_SETUP
    install(root, write_env(tmp_path / "src", "olddl", ["old-a", "old-b"], body=body))
    make_worker_old(root / "envs" / "olddl")
    add_json(root, "old-a")
    add_json(root, "old-b")
    # The scan sees what each download made; common.bin was new only for old-a, and
    # nothing reports that old-b's hook returned it.
    assert files_of(root, "olddl", "old-a") == sorted(
        [
            *hub("old-a"),
            "cache/hub/models--org--m/blobs/config",
            "cache/shared/common.bin",
            "home/.cache/mylib/old-a.pt",
        ]
    )
    assert files_of(root, "olddl", "old-b") == sorted(
        [*hub("old-b"), "cache/hub/models--org--m/blobs/config", "home/.cache/mylib/old-b.pt"]
    )


def make_worker_old(env: Path) -> None:
    """Make the env's vendored worker ignore ``$ROOTSTOCK_DOWNLOAD_RESULT``, as a worker
    built by an older rootstock does (it never heard of it)."""
    (main,) = env.glob("lib/python3*/site-packages/rootstock/worker/main.py")
    source = main.read_text()
    old, count = re.subn(r"os\.environ\.pop\(DOWNLOAD_RESULT_ENV, \"\"\)", '""', source)
    assert count == 1, "the worker no longer reads the variable this way: update this test"
    # A new file renamed into place: the old one may be a hard link into uv's cache.
    replacement = main.with_name(".main.py.new")
    replacement.write_text(old)
    os.replace(replacement, main)
    for compiled in (main.parent / "__pycache__").glob("main.*.pyc"):
        compiled.unlink()


# --- the rules, in-process ------------------------------------------------------------


def test_returned_paths_keeps_paths_and_drops_the_rest(tmp_path: Path) -> None:
    assert returned_paths(None) == []
    assert returned_paths(str(tmp_path / "w.pt")) == [str(tmp_path / "w.pt")]
    assert returned_paths(tmp_path / "w.pt") == [str(tmp_path / "w.pt")]
    assert returned_paths(("/a", b"/b", 5, "", "x\0y", {"k": 1})) == ["/a", "/b"]
    assert returned_paths(["relative/w.pt"]) == [os.path.abspath("relative/w.pt")]
    assert returned_paths(42) == [] and returned_paths({"/a"}) == []


def test_attribution_follows_links_and_directories_and_stays_inside(tmp_path: Path) -> None:
    cache_root = tmp_path / "cr"
    layout = InstallLayout(tmp_path / "root", cache_root)
    blobs = cache_root / "cache" / "hub" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "old").write_text("old")
    (cache_root / "usage").mkdir()
    (cache_root / "usage" / "u.json").write_text("{}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x").write_text("x")
    before = scan_cache(layout)

    snap = cache_root / "cache" / "hub" / "snap"
    snap.mkdir()
    (snap / "w").symlink_to("../blobs/old")  # new link to an old blob
    (snap / "out").symlink_to(elsewhere / "x")  # a link out of the cache root
    (snap / "dirlink").symlink_to(elsewhere)  # never followed by the scan
    home = cache_root / "home" / ".cache"
    home.mkdir(parents=True)
    (home / "m.pt").write_text("m")
    after = scan_cache(layout)
    assert str(snap / "dirlink") in after and str(snap / "dirlink" / "x") not in after

    found = attributed_files(
        layout,
        before,
        after,
        [str(cache_root / "usage" / "u.json"), str(elsewhere), str(cache_root / "cache")],
    )
    assert found == [
        "cache/hub/blobs/old",
        "cache/hub/snap/dirlink",
        "cache/hub/snap/out",
        "cache/hub/snap/w",
        "home/.cache/m.pt",
    ]
    # A changed file counts; an unchanged one does not.
    (blobs / "old").write_text("changed, longer")
    assert attributed_files(layout, after, scan_cache(layout), []) == ["cache/hub/blobs/old"]


def test_attribution_through_a_symlinked_cache_root(tmp_path: Path) -> None:
    real = tmp_path / "real-cache-root"
    (real / "cache" / "lib").mkdir(parents=True)
    (real / "cache" / "lib" / "w.pt").write_text("w")
    link = tmp_path / "cr"
    link.symlink_to(real)
    layout = InstallLayout(tmp_path / "root", link)
    # A hook may hand back the resolved path; it is the same file.
    found = attributed_files(layout, {}, {}, [str(real / "cache" / "lib")])
    assert found == ["cache/lib/w.pt"]


def test_a_name_json_cannot_hold_stays_unattributed(tmp_path: Path) -> None:
    layout = InstallLayout(tmp_path / "root", tmp_path / "cr")
    lib = tmp_path / "cr" / "cache" / "lib"
    lib.mkdir(parents=True)
    before = scan_cache(layout)
    with open(os.path.join(os.fsencode(lib), b"latin1-\xe9.pt"), "w") as fh:
        fh.write("w")
    (lib / "ok.pt").write_text("w")
    after = scan_cache(layout)
    assert len(after) == 2
    assert attributed_files(layout, before, after, []) == ["cache/lib/ok.pt"]


def test_the_spawner_reads_only_a_json_list_of_paths(tmp_path: Path) -> None:
    from rootstock.runtime.spawn import _read_download_result

    result = tmp_path / "download-result.json"
    assert _read_download_result(result) == []  # an older worker wrote none
    for junk in (b"not json", b'{"a": 1}', b'["/a", 5]', b"\xff\xfe", b"[NaN]"):
        result.write_bytes(junk)
        assert _read_download_result(result) == []
    result.write_text('["/a", "/b c"]')
    assert _read_download_result(result) == ["/a", "/b c"]
