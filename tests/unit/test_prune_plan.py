"""``rootstock prune``'s planner and its in-process execution, on installs made by hand.

The installs here are laid out the way ``install`` lays them out (a generation
directory with ``env_source.py`` and a generation lock, ``envs/<n>`` linking to
it, the registered source, a manifest written through the manifest API) but
without uv, so every rule can be pinned quickly: reference counting of attributed
files, the variant keep rule, the age rule, the lint guard, ``--deep``, and the
journal a killed prune leaves. Real builds and a real running worker are in
``tests/integration/test_prune.py``.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from rootstock.errors import SourceError
from rootstock.install.generations import make_generation_lock
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    ensure_manifest,
    load_manifest,
    record_env_build,
    record_fetch,
    update_manifest,
)
from rootstock.install.prune_journal import PruneJournal, read_journal, write_journal
from rootstock.ops.prune import prune, uv_removed_bytes
from rootstock.ops.prune_entries import old_enough
from rootstock.ops.prune_plan import covers, files_to_delete, other_clusters_served, plan_prune
from rootstock.ops.sources import EnvSource
from tests.integration.checkpoint_envs import write_env

DAY = 24 * 3600.0


def source_of(directory: Path) -> EnvSource:
    """A directory SOURCE, as ``open_source`` hands it over."""
    files = sorted(directory.glob("*.py"))
    return EnvSource(label=str(directory), kind="dir", directory=directory, files=files)


def build_by_hand(layout: InstallLayout, name: str, ids: list[str], tables: str = "") -> Path:
    """One env as ``install`` leaves it: a generation, its link, its registered source."""
    source = write_env(layout.environments_dir, name, ids, tables=tables)
    (layout.environments_dir / f"{name}.py.lock").write_text("lock\n")
    generation = layout.envs_dir / f".{name}.{int(time.time())}-{os.urandom(3).hex()}"
    generation.mkdir()
    (generation / "env_source.py").write_text(source.read_text())
    make_generation_lock(generation)
    link = layout.env_dir(name)
    link.unlink(missing_ok=True)
    link.symlink_to(generation.name)
    record_env_build(layout, name, {"source_hash": "sha256:" + "0" * 64})
    return generation


def weights(layout: InstallLayout, env: str, checkpoint: str, files: dict[str, bytes]) -> None:
    """Write ``files`` under the cache root and record them as ``checkpoint``'s download."""
    for relative, data in files.items():
        path = layout.cache_root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    record_fetch(layout, env, checkpoint, files=sorted(files))


def age(path: Path, seconds: float) -> None:
    """Make ``path`` (not what a link points at) ``seconds`` old."""
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


@pytest.fixture
def layout(tmp_path: Path) -> InstallLayout:
    root = tmp_path / "root"
    made = InstallLayout(root, root)
    for directory in (made.environments_dir, made.envs_dir, made.cache_dir, made.home_dir):
        directory.mkdir(parents=True)
    ensure_manifest(made, ["testbox"])
    return made


def tree(root: Path) -> dict[str, tuple[str, str]]:
    """Every path under ``root``: its type and content hash (links: their target)."""
    found: dict[str, tuple[str, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                found[rel] = ("dir", "")
            else:
                found[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return found


# --- the pure rules -------------------------------------------------------------------


def test_attributed_files_are_reference_counted(layout: InstallLayout) -> None:
    build_by_hand(layout, "a", ["x", "y"])
    build_by_hand(layout, "b", ["z"])
    weights(layout, "a", "x", {"cache/x.bin": b"x", "cache/shared.bin": b"s"})
    weights(layout, "a", "y", {"cache/shared.bin": b"s", "cache/y.bin": b"y"})
    weights(layout, "b", "z", {"cache/model-dir": b"z"})
    manifest = load_manifest(layout)

    deleted, shared = files_to_delete(manifest, {("a", "x")}, set())
    assert deleted == {("a", "x"): ["cache/x.bin"]}
    assert shared == {("a", "x"): ["cache/shared.bin"]}

    # Both users of the shared file go: it goes too, once, with the first record.
    deleted, shared = files_to_delete(manifest, set(), {"a"})
    assert deleted == {("a", "x"): ["cache/shared.bin", "cache/x.bin"], ("a", "y"): ["cache/y.bin"]}
    assert shared == {("a", "x"): [], ("a", "y"): []}


def test_a_listed_directory_covers_the_files_under_it() -> None:
    listed = {"home/.cache/model", "cache/hf/blob"}
    assert covers("home/.cache/model/weights.pt", listed)
    assert covers("cache/hf", listed)  # deleting it would take a surviving file
    assert not covers("home/.cache/modelx", listed)
    assert not covers("cache/other", listed)


def test_unattributed_records_and_unsafe_paths_delete_nothing() -> None:
    manifest = {
        "schema_version": 3,
        "clusters": ["testbox"],
        "envs": {
            "a": {
                "checkpoints": {
                    "old": {"fetched_at": "2024-01-01T00:00:00+00:00"},
                    "bad": {"files": ["../../etc/passwd", "/etc/passwd", "cache/ok"]},
                }
            }
        },
    }
    deleted, _ = files_to_delete(manifest, {("a", "old"), ("a", "bad")}, set())  # type: ignore[arg-type]
    assert deleted == {("a", "bad"): ["cache/ok"], ("a", "old"): []}


@pytest.mark.parametrize(
    ("clusters", "this", "served", "kept"),
    [
        (None, "della", ["della", "stellar"], []),  # universal: SOURCE decides
        (["stellar"], "della", ["della", "stellar"], ["stellar"]),  # another cluster's variant
        (["della", "stellar"], "della", ["della", "stellar"], []),  # lists this one too
        (["tiger"], "della", ["della", "stellar"], []),  # serves no cluster of this install
        (["Stellar"], None, ["della", "stellar"], ["stellar"]),  # no --cluster: kept
        (["della"], None, ["della", "stellar"], ["della"]),
    ],
)
def test_variant_keep_rule(
    clusters: list[str] | None, this: str | None, served: list[str], kept: list[str]
) -> None:
    assert other_clusters_served(clusters, this, served) == kept


def test_age_rule() -> None:
    now = 1_000_000.0
    assert old_enough(now - DAY, now, DAY)
    assert not old_enough(now - DAY + 1, now, DAY)
    assert old_enough(now, now, 0.0)


def test_uv_removed_bytes_reads_uvs_summary() -> None:
    assert uv_removed_bytes("Pruning cache at: /c\nRemoved 12 files (1.5MiB)\n") == 1572864
    assert uv_removed_bytes("Pruning cache at: /c\nNo unused entries found\n") == 0


# --- the plan ---------------------------------------------------------------------------


def test_an_env_removed_from_source_goes_with_its_records_and_files(
    layout: InstallLayout, tmp_path: Path
) -> None:
    build_by_hand(layout, "a", ["x"])
    gen_b = build_by_hand(layout, "b", ["z"])
    weights(layout, "a", "x", {"cache/shared.bin": b"s"})
    weights(layout, "b", "z", {"cache/shared.bin": b"s", "cache/z.bin": b"z" * 10000})
    src = tmp_path / "src"
    write_env(src, "a", ["x"])

    plan = plan_prune(layout, source_of(src), min_age_s=0)
    assert {(e.kind, e.name) for e in plan.entries} == {("env", "b"), ("checkpoint", "z")}
    checkpoint = next(e for e in plan.entries if e.kind == "checkpoint")
    assert checkpoint.paths == ["cache/z.bin"] and checkpoint.shared == ["cache/shared.bin"]
    assert checkpoint.bytes and checkpoint.bytes >= 10000

    report = prune(layout, plan)
    assert report.ok, report.to_dict()
    assert {r.status for r in report.results} == {"deleted"}
    assert not layout.env_dir("b").is_symlink() and not gen_b.exists()
    assert not (layout.environments_dir / "b.py").exists()
    assert not (layout.environments_dir / "b.py.lock").exists()
    assert not (layout.cache_root / "cache/z.bin").exists()
    assert (layout.cache_root / "cache/shared.bin").read_bytes() == b"s"
    manifest = load_manifest(layout)
    assert set(manifest["envs"]) == {"a"}
    assert layout.env_source("a").is_file() and (layout.environments_dir / "a.py").is_file()
    assert read_journal(layout) is None
    assert report.reclaimed_bytes >= 10000


def test_undeclared_records_go_but_custom_ids_stay(layout: InstallLayout, tmp_path: Path) -> None:
    build_by_hand(layout, "a", ["x", "y", "a:custom"])
    weights(layout, "a", "x", {"cache/x.bin": b"x"})
    weights(layout, "a", "y", {"cache/y.bin": b"y"})
    record_fetch(layout, "a", "a:custom")
    src = tmp_path / "src"
    write_env(src, "a", ["y"])

    plan = plan_prune(layout, source_of(src), min_age_s=0)
    assert [(e.kind, e.env, e.name) for e in plan.entries] == [("checkpoint", "a", "x")]
    assert "no longer declared by" in plan.entries[0].reason

    assert prune(layout, plan).ok
    records = load_manifest(layout)["envs"]["a"]["checkpoints"]
    assert set(records) == {"y", "a:custom"}
    assert not (layout.cache_root / "cache/x.bin").exists()
    assert (layout.cache_root / "cache/y.bin").exists()


def test_without_source_an_env_with_no_registered_source_goes(layout: InstallLayout) -> None:
    build_by_hand(layout, "a", ["x"])
    build_by_hand(layout, "b", ["z"])
    (layout.environments_dir / "b.py").unlink()

    plan = plan_prune(layout, None, min_age_s=0)
    assert [(e.kind, e.name) for e in plan.entries] == [("env", "b")]
    assert "no registered source" in plan.entries[0].reason
    # Its lockfile goes with it (not twice, as an orphaned lockfile too).
    assert plan.entries[0].registered == ["environments/b.py.lock"]


def test_a_variant_of_another_cluster_is_kept(layout: InstallLayout, tmp_path: Path) -> None:
    ensure_manifest(layout, ["testbox", "otherbox"])
    build_by_hand(layout, "a", ["x"])
    build_by_hand(layout, "a_other", ["x"], tables='CLUSTERS = ["otherbox"]\n')
    src = tmp_path / "src"
    write_env(src, "a", ["x"])

    plan = plan_prune(layout, source_of(src), min_age_s=0, cluster="testbox")
    assert plan.entries == []
    assert [(e.kind, e.name) for e in plan.kept] == [("env", "a_other")]
    assert "otherbox" in plan.kept[0].reason


@pytest.mark.parametrize("problem", ["lint", "empty"])
def test_a_bad_source_refuses_to_prune_anything(
    layout: InstallLayout, tmp_path: Path, problem: str
) -> None:
    build_by_hand(layout, "a", ["x"])
    build_by_hand(layout, "b", ["z"])
    src = tmp_path / "src"
    write_env(src, "a", ["x"])
    if problem == "lint":
        (src / "b.py").write_text("CHECKPOINTS = {}\n")  # no script block, no setup()
        files = sorted(src.glob("*.py"))
    else:
        files = []
    before = tree(layout.root)
    source = EnvSource(label=str(src), kind="dir", directory=src, files=files)
    with pytest.raises(SourceError) as raised:
        plan_prune(layout, source, min_age_s=0)
    assert "nothing is pruned" in raised.value.message
    if problem == "lint":
        assert "b.py" in raised.value.message
    assert tree(layout.root) == before


def test_garbage_is_collected_only_once_older_than_min_age(layout: InstallLayout) -> None:
    old_gen = build_by_hand(layout, "a", ["x"])
    build_by_hand(layout, "a", ["x"])  # a rebuild: the first generation is now old
    orphan_lock = layout.environments_dir / "gone.py.lock"
    orphan_lock.write_text("lock\n")
    interpreter = layout.python_dir / "cpython-3.99.0-linux-x86_64-gnu"
    (interpreter / "bin").mkdir(parents=True)
    (interpreter / "bin" / "python3.99").write_text("")

    young = plan_prune(layout, None)
    assert young.entries == []
    assert {e.kind for e in young.kept} == {"generation", "lockfile", "interpreter"}
    assert all("younger than --min-age" in e.reason for e in young.kept)

    for path in (old_gen, orphan_lock, interpreter, layout.env_dir("a")):
        age(path, 2 * DAY)
    plan = plan_prune(layout, None)
    assert {(e.kind, e.name) for e in plan.entries} == {
        ("generation", f"envs/{old_gen.name}"),
        ("lockfile", "environments/gone.py.lock"),
        ("interpreter", ".python/cpython-3.99.0-linux-x86_64-gnu"),
    }
    assert prune(layout, plan).ok
    assert not old_gen.exists() and not orphan_lock.exists() and not interpreter.exists()
    assert layout.env_source("a").is_file()


def test_an_interpreter_an_env_records_stays(layout: InstallLayout) -> None:
    interpreter = layout.python_dir / "cpython-3.11.9-linux-x86_64-gnu"
    (interpreter / "bin").mkdir(parents=True)
    (interpreter / "bin" / "python3.11").write_text("")
    generation = build_by_hand(layout, "a", ["x"])
    (generation / "pyvenv.cfg").write_text(f"home = {interpreter / 'bin'}\n")
    age(interpreter, 2 * DAY)
    assert plan_prune(layout, None).entries == []


def test_deep_deletes_only_unattributed_content(layout: InstallLayout) -> None:
    build_by_hand(layout, "a", ["x"])
    weights(layout, "a", "x", {"cache/hf/kept.bin": b"k"})
    stray = {
        layout.cache_dir / "hf" / "stray.bin": b"s" * 5000,
        layout.home_dir / ".cache" / "w": b"w",
    }
    for path, data in stray.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        age(path, 2 * DAY)

    shallow = plan_prune(layout, None)
    assert shallow.entries == []  # always reported, never deleted without --deep
    assert shallow.unattributed.files == 2
    assert sorted(shallow.unattributed.dirs) == ["cache/hf", "home/.cache"]

    deep = plan_prune(layout, None, deep=True)
    assert {(e.kind, e.name, e.count) for e in deep.entries if e.kind != "uv-cache"} == {
        ("unattributed", "cache/hf", 1),
        ("unattributed", "home/.cache", 1),
    }
    assert prune(layout, deep).ok
    assert not any(path.exists() for path in stray)
    assert not (layout.home_dir / ".cache").exists()  # left empty: removed
    assert (layout.cache_dir / "hf" / "kept.bin").read_bytes() == b"k"
    assert layout.home_dir.is_dir()


@pytest.mark.parametrize("opened", [False, True])
def test_a_pending_journal_is_finished_first(layout: InstallLayout, opened: bool) -> None:
    """A prune killed after its transaction: records gone, deletions still owed.

    ``opened``: the registered sources as the CLI opens them, listed before the
    journal removed one of them.
    """
    build_by_hand(layout, "a", ["x"])
    gen_b = build_by_hand(layout, "b", ["z"])
    weights(layout, "b", "z", {"cache/z.bin": b"z"})

    def killed_prune(data):  # what step 1 did before the kill
        data["envs"].pop("b")
        write_journal(
            layout,
            PruneJournal(["cache/z.bin"], ["b"], ["environments/b.py", "environments/b.py.lock"]),
        )

    update_manifest(layout, killed_prune)
    source = None
    if opened:
        files = sorted(layout.environments_dir.glob("*.py"))
        source = EnvSource("registered", "registered", layout.environments_dir, files)
    plan = plan_prune(layout, source, min_age_s=DAY)
    assert plan.pending_journal and not plan.empty

    report = prune(layout, plan)
    assert report.ok
    assert report.finished_journal is not None
    assert "cache/z.bin" in report.finished_journal.deleted
    assert not gen_b.exists() and not layout.env_dir("b").is_symlink()
    assert not (layout.environments_dir / "b.py").exists()
    assert read_journal(layout) is None
    assert layout.env_source("a").is_file()


def test_a_journal_whose_records_survived_deletes_none_of_them(layout: InstallLayout) -> None:
    """Killed between the journal and the manifest write: the records are still there."""
    gen = build_by_hand(layout, "b", ["z"])
    weights(layout, "b", "z", {"cache/z.bin": b"z"})
    write_journal(layout, PruneJournal(["cache/z.bin"], ["b"], ["environments/b.py"]))

    report = prune(layout, plan_prune(layout, None, min_age_s=DAY))
    assert report.ok and read_journal(layout) is None
    assert gen.exists() and (layout.cache_root / "cache/z.bin").exists()
    assert (layout.environments_dir / "b.py").exists()


def test_execution_acts_only_on_what_is_still_prunable(layout: InstallLayout) -> None:
    build_by_hand(layout, "a", ["x"])
    build_by_hand(layout, "b", ["z"])
    (layout.environments_dir / "b.py").unlink()
    plan = plan_prune(layout, None, min_age_s=0)
    assert [e.name for e in plan.entries] == ["b"]
    write_env(layout.environments_dir, "b", ["z"])  # registered again after the plan

    report = prune(layout, plan)
    assert [(r.name, r.status) for r in report.results] == [("b", "skipped")]
    assert layout.env_source("b").is_file() and "b" in load_manifest(layout)["envs"]


def test_without_coherent_locks_generations_go_by_age_only(
    layout: InstallLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rootstock.install.generations import LockCoherence

    old_gen = build_by_hand(layout, "a", ["x"])
    build_by_hand(layout, "a", ["x"])
    monkeypatch.setattr(
        "rootstock.ops.prune_garbage.locks_are_coherent",
        lambda _path: LockCoherence(False, "nfs4", "NFS mounted nolock: locks are local"),
    )
    young = plan_prune(layout, None)
    assert any("kept by age (--min-age) only" in n and "nolock" in n for n in young.notes)
    assert [e.kind for e in young.kept] == ["generation"]

    for path in (old_gen, layout.env_dir("a")):
        age(path, 2 * DAY)
    plan = plan_prune(layout, None)
    assert [e.name for e in plan.entries] == [f"envs/{old_gen.name}"]
    assert "not coherent here, kept by age only" in plan.entries[0].reason


def test_a_generation_without_a_lock_file_goes_by_age(layout: InstallLayout) -> None:
    old_gen = build_by_hand(layout, "a", ["x"])
    build_by_hand(layout, "a", ["x"])
    (old_gen / ".rootstock-generation.lock").unlink()  # built before generation locks
    for path in (old_gen, layout.env_dir("a")):
        age(path, 2 * DAY)
    plan = plan_prune(layout, None)
    assert [e.name for e in plan.entries] == [f"envs/{old_gen.name}"]
    assert "no generation lock file" in plan.entries[0].reason
    assert prune(layout, plan).ok and not old_gen.exists()


def test_an_env_named_like_a_prefix_keeps_the_other_envs_generations(
    layout: InstallLayout, tmp_path: Path
) -> None:
    build_by_hand(layout, "a", ["x"])
    kept = build_by_hand(layout, "a.b", ["y"])
    src = tmp_path / "src"
    write_env(src, "a.b", ["y"])
    plan = plan_prune(layout, source_of(src), min_age_s=0)
    assert [(e.kind, e.name) for e in plan.entries] == [("env", "a")]
    assert prune(layout, plan).ok
    assert kept.is_dir() and layout.env_source("a.b").is_file()


def test_deleting_a_checkpoints_files_removes_the_directories_it_leaves_empty(
    layout: InstallLayout,
) -> None:
    from rootstock.install.prune_journal import carry_out

    gone = layout.cache_dir / "hub" / "models--x" / "blobs" / "abc"
    other = layout.cache_dir / "hub" / "models--y" / "blobs" / "def"
    for path in (gone, other):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"w")
    journal = PruneJournal(files=["cache/hub/models--x/blobs/abc"])
    carry_out(layout, journal, {"schema_version": 1, "clusters": ["testbox"], "envs": {}})
    assert not (layout.cache_dir / "hub" / "models--x").exists()
    assert other.read_bytes() == b"w"  # a sibling's directories stay
    assert layout.cache_dir.is_dir()  # cache/ itself is never removed
