"""The ``rootstock sync`` planner, purely: install states and env files in, items out.

Every state here is built in memory (a manifest dict, :class:`BuiltEnv` records and
:class:`EnvFile` objects), so each reason and note of docs/cli.md's ``sync`` section
is pinned without uv, a worker or a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rootstock.errors import CheckpointNotDeclared, UnknownEnvName, UsageError
from rootstock.install.envfile import EnvFile, LintProblem
from rootstock.install.manifest import Manifest, new_manifest
from rootstock.ops.sources import EnvSource
from rootstock.ops.sync import (
    ItemResult,
    PreparedSync,
    SyncHooks,
    SyncRun,
    execute_plan,
    parse_phases,
)
from rootstock.ops.sync_plan import (
    LINT_FAILED,
    NEVER_VERIFIED,
    NEWLY_BUILT,
    NEWLY_FETCHED,
    NO_BUILD_RECORD,
    NOT_BUILT,
    NOT_FETCHED,
    REBUILD,
    SOURCE_DIFFERS,
    UPGRADE,
    BuiltEnv,
    InstallState,
    PlanItem,
    RejectedFile,
    SyncOptions,
    SyncPlan,
    check_scope,
    plan_sync,
    public_version,
)

CLUSTER = "testbox"
STAMP = "2026-01-01T00:00:00+00:00"


def env_file(
    name: str, ids: list[str], *, extra: str = "", clusters: list[str] | None = None
) -> EnvFile:
    """A declared env file (as SOURCE holds it), parsed already."""
    source = f"# {name}\nCHECKPOINTS = {dict.fromkeys(ids, 'x')!r}\n{extra}"
    return EnvFile(
        path=Path(f"/src/{name}.py"),
        name=name,
        source=source,
        checkpoints=dict.fromkeys(ids, "x"),
        clusters=clusters,
    )


def built(
    env: EnvFile,
    *,
    live: EnvFile | None = None,
    rootstock: str | None = "0.1.0+habc",
    broken: str | None = None,
    no_build_record: bool = False,
) -> BuiltEnv:
    """``env`` as built (``live``: a hotfixed env_source.py, else the same file)."""
    current = live or env
    return BuiltEnv(
        env.name,
        None if no_build_record else env.source_hash,
        current.source_hash,
        tuple(current.checkpoints),
        tuple(current.clusters) if current.clusters is not None else None,
        rootstock,
        broken,
    )


def build_ref(env: EnvFile, source: str | None = None) -> dict[str, Any]:
    return {
        "build_id": f"b-{env.name}",
        "built_at": STAMP,
        "lock_hash": "sha256:lock",
        "source_hash": source or env.source_hash,
    }


def record(env: EnvFile, state: str = "verified", **build: Any) -> dict[str, Any]:
    """A stored CPU verification on CLUSTER against ``env``'s build (overridable)."""
    return {
        "state": state,
        "at": STAMP,
        "device": "cpu",
        "device_kind": "cpu",
        "message": None if state == "verified" else f"synthetic {state}",
        "build": {**build_ref(env), **build},
    }


def manifest(*entries: tuple[EnvFile, dict[str, dict[str, Any]]]) -> Manifest:
    """A manifest with each env's build record and ``{id: checkpoint record}``."""
    data = new_manifest([CLUSTER])
    for env, checkpoints in entries:
        ref = build_ref(env)
        data["envs"][env.name] = {
            "build_id": ref["build_id"],
            "built_at": ref["built_at"],
            "lock_hash": ref["lock_hash"],
            "source_hash": ref["source_hash"],
            "checkpoints": checkpoints,  # type: ignore[typeddict-item]
        }
    return data


def verified_entry(env: EnvFile, state: str = "verified", **build: Any) -> dict[str, Any]:
    return {"fetched_at": STAMP, "verifications": {CLUSTER: {"cpu": record(env, state, **build)}}}


def state_of(
    data: Manifest,
    *envs: BuiltEnv,
    cluster: str | None = CLUSTER,
    kind: str = "cpu",
    pending_prune: bool = False,
) -> InstallState:
    return InstallState(
        data, {e.name: e for e in envs}, cluster, kind, "0.1.0", pending_prune=pending_prune
    )


def steps(plan: SyncPlan) -> list[tuple[str, str, str]]:
    """(phase, env[/id], reason) of every item, in plan order."""
    return [(i.phase, i.key, i.reason) for i in plan.items]


def converged(env: EnvFile) -> tuple[InstallState, list[EnvFile]]:
    data = manifest((env, {cid: verified_entry(env) for cid in env.checkpoints}))
    return state_of(data, built(env)), [env]


# --- build reasons ----------------------------------------------------------------------


def test_an_empty_install_gets_a_build_then_downloads_then_verifies() -> None:
    emt = env_file("emt", ["emt", "emt-2"])
    plan = plan_sync(state_of(new_manifest([CLUSTER])), [emt], SyncOptions())
    assert steps(plan) == [
        ("build", "emt", NOT_BUILT),
        ("download", "emt/emt", NOT_FETCHED),
        ("download", "emt/emt-2", NOT_FETCHED),
        ("verify", "emt/emt", NEWLY_FETCHED),
        ("verify", "emt/emt-2", NEWLY_FETCHED),
    ]
    build = plan.items[0]
    assert build.path == emt.path and build.force is False and build.symbol == "+"
    assert plan.notes == []
    assert plan.counts() == {"build": 1, "download": 2, "verify": 2}


def test_a_converged_install_plans_nothing_and_notes_nothing() -> None:
    state, declared = converged(env_file("emt", ["emt"]))
    plan = plan_sync(state, declared, SyncOptions())
    assert plan.items == [] and plan.notes == []


def test_a_changed_source_is_rebuilt_and_its_fetched_ids_reverified() -> None:
    old = env_file("emt", ["emt"])
    new = env_file("emt", ["emt", "emt-new"], extra="SCALE = 2\n")
    data = manifest((old, {"emt": verified_entry(old)}))
    plan = plan_sync(state_of(data, built(old)), [new], SyncOptions())
    assert steps(plan) == [
        ("build", "emt", SOURCE_DIFFERS),
        ("download", "emt/emt-new", NOT_FETCHED),
        ("verify", "emt/emt", NEWLY_BUILT),
        ("verify", "emt/emt-new", NEWLY_FETCHED),
    ]
    assert plan.items[0].force is True and plan.items[0].symbol == "~"


def test_an_env_without_build_metadata_is_rebuilt() -> None:
    emt = env_file("emt", ["emt"])
    data = manifest((emt, {"emt": verified_entry(emt)}))
    plan = plan_sync(state_of(data, built(emt, no_build_record=True)), [emt], SyncOptions())
    assert steps(plan)[0] == ("build", "emt", NO_BUILD_RECORD)


@pytest.mark.parametrize(
    ("options", "reason"),
    [(SyncOptions(rebuild=True), REBUILD), (SyncOptions(upgrade=True), UPGRADE)],
)
def test_rebuild_and_upgrade_rebuild_a_converged_env(options: SyncOptions, reason: str) -> None:
    state, declared = converged(env_file("emt", ["emt"]))
    plan = plan_sync(state, declared, options)
    assert steps(plan) == [("build", "emt", reason), ("verify", "emt/emt", NEWLY_BUILT)]


# --- the hotfix rule --------------------------------------------------------------------


def test_a_hotfix_is_not_reverted_it_is_noted_and_reverified() -> None:
    emt = env_file("emt", ["emt"])
    hotfixed = env_file("emt", ["emt"], extra="# hotfix\n")
    data = manifest((emt, {"emt": verified_entry(emt)}))  # verified before the hotfix
    plan = plan_sync(state_of(data, built(emt, live=hotfixed)), [emt], SyncOptions())
    assert [i.phase for i in plan.items] == ["verify"]
    assert plan.items[0].reason.startswith("stale: env_source.py changed since verification")
    assert len(plan.notes) == 1 and "hotfixed; not rebuilt" in plan.notes[0]


def test_a_hotfix_already_verified_needs_only_its_note() -> None:
    emt = env_file("emt", ["emt"])
    hotfixed = env_file("emt", ["emt"], extra="# hotfix\n")
    entry = verified_entry(emt, source_hash=hotfixed.source_hash)
    data = manifest((emt, {"emt": entry}))
    plan = plan_sync(state_of(data, built(emt, live=hotfixed)), [emt], SyncOptions())
    assert plan.items == []
    assert "hotfixed" in plan.notes[0]


def test_new_source_over_a_hotfix_is_built() -> None:
    emt = env_file("emt", ["emt"])
    hotfixed = env_file("emt", ["emt"], extra="# hotfix\n")
    edited = env_file("emt", ["emt"], extra="SCALE = 3\n")
    data = manifest((emt, {"emt": verified_entry(emt)}))
    plan = plan_sync(state_of(data, built(emt, live=hotfixed)), [edited], SyncOptions())
    assert steps(plan)[0] == ("build", "emt", SOURCE_DIFFERS)
    assert not any("hotfixed" in n for n in plan.notes)


def test_a_broken_env_with_unchanged_source_is_noted_not_rebuilt_nor_verified() -> None:
    emt = env_file("emt", ["emt"])
    data = manifest((emt, {"emt": verified_entry(emt)}))
    broken = built(emt, live=env_file("emt", ["emt"], extra="def (\n"), broken="x.py:3: bad")
    plan = plan_sync(state_of(data, broken), [emt], SyncOptions())
    assert plan.items == []
    assert "broken (x.py:3: bad)" in plan.notes[0] and "--rebuild --env emt" in plan.notes[0]


# --- verify reasons ---------------------------------------------------------------------


def test_fetched_never_verified_for_this_device_kind_is_verified() -> None:
    emt = env_file("emt", ["emt"])
    data = manifest((emt, {"emt": verified_entry(emt)}))  # a CPU record only
    plan = plan_sync(state_of(data, built(emt), kind="gpu"), [emt], SyncOptions())
    assert steps(plan) == [("verify", "emt/emt", f"{NEVER_VERIFIED} on {CLUSTER} (gpu)")]


def test_fetched_on_another_cluster_only_is_verified_here() -> None:
    emt = env_file("emt", ["emt"])
    entry = {"fetched_at": STAMP, "verifications": {"other": {"cpu": record(emt)}}}
    plan = plan_sync(state_of(manifest((emt, {"emt": entry})), built(emt)), [emt], SyncOptions())
    assert steps(plan) == [("verify", "emt/emt", f"{NEVER_VERIFIED} on {CLUSTER} (cpu)")]


def test_a_failure_last_time_is_verified_again() -> None:
    emt = env_file("emt", ["emt"])
    data = manifest((emt, {"emt": verified_entry(emt, "failed")}))
    plan = plan_sync(state_of(data, built(emt)), [emt], SyncOptions())
    assert steps(plan) == [("verify", "emt/emt", "failed last time: synthetic failed")]


def test_stale_after_a_rebuild_outside_sync_is_verified() -> None:
    emt = env_file("emt", ["emt"])
    data = manifest((emt, {"emt": verified_entry(emt, build_id="an-older-build")}))
    plan = plan_sync(state_of(data, built(emt)), [emt], SyncOptions())
    assert [i.phase for i in plan.items] == ["verify"]
    assert plan.items[0].reason.startswith("stale: env rebuilt since verification")


def test_drifted_is_a_note_naming_accept_drift() -> None:
    emt = env_file("emt", ["emt"])
    data = manifest((emt, {"emt": verified_entry(emt, "drifted")}))
    plan = plan_sync(state_of(data, built(emt)), [emt], SyncOptions())
    assert plan.items == []
    assert plan.notes == [
        f"emt/emt: drifted on {CLUSTER} (cpu); accept it with "
        "`rootstock add emt --accept-drift`, or investigate"
    ]


def test_custom_ids_are_never_downloaded_or_verified() -> None:
    env = env_file("fam", ["fam-1", "fam:custom"])
    plan = plan_sync(state_of(new_manifest([CLUSTER])), [env], SyncOptions())
    assert [i.checkpoint for i in plan.items if i.checkpoint] == ["fam-1", "fam-1"]


# --- notes ------------------------------------------------------------------------------


def test_an_env_built_by_another_rootstock_version_is_noted() -> None:
    emt = env_file("emt", ["emt"])
    data = manifest((emt, {"emt": verified_entry(emt)}))
    plan = plan_sync(state_of(data, built(emt, rootstock="0.0.9+h123")), [emt], SyncOptions())
    assert plan.items == []
    assert plan.notes == [
        "emt: built by rootstock 0.0.9, this is 0.1.0; "
        "--rebuild --env emt rebuilds it with this version"
    ]


def test_the_wheel_content_hash_is_not_another_version() -> None:
    assert public_version("0.1.0+h0123456789ab") == "0.1.0"
    emt = env_file("emt", ["emt"])
    data = manifest((emt, {"emt": verified_entry(emt)}))
    plan = plan_sync(state_of(data, built(emt, rootstock="0.1.0+hfff")), [emt], SyncOptions())
    assert plan.notes == []


def test_a_variant_for_another_cluster_is_built_but_not_fetched_or_verified_here() -> None:
    gamma = env_file("emt-gamma", ["g-1"], clusters=["gamma"])
    plan = plan_sync(state_of(new_manifest([CLUSTER])), [gamma], SyncOptions())
    assert steps(plan) == [("build", "emt-gamma", NOT_BUILT)]
    assert plan.notes == [
        f"emt-gamma: a variant for gamma, not {CLUSTER}: "
        "its checkpoints are downloaded and verified from those clusters"
    ]


def test_a_variant_for_this_cluster_shadows_the_universal_id() -> None:
    universal = env_file("emt", ["emt", "only-universal"])
    variant = env_file("emt-here", ["emt"], clusters=[CLUSTER])
    plan = plan_sync(state_of(new_manifest([CLUSTER])), [universal, variant], SyncOptions())
    served = {(i.env, i.checkpoint) for i in plan.items if i.phase == "verify"}
    assert served == {("emt", "only-universal"), ("emt-here", "emt")}


def test_a_pending_prune_journal_is_noted() -> None:
    state, declared = converged(env_file("emt", ["emt"]))
    state = state_of(state.manifest, *state.envs.values(), pending_prune=True)
    plan = plan_sync(state, declared, SyncOptions())
    assert plan.notes == ["an interrupted prune left a journal: sync finishes its deletions first"]


# --- scope: phases, envs, checkpoints, no cluster ---------------------------------------


def test_only_the_verify_phase_notes_what_the_others_would_do() -> None:
    absent = env_file("absent", ["a-1"])
    emt = env_file("emt", ["emt", "emt-unfetched"])
    data = manifest((emt, {"emt": verified_entry(emt, "failed")}))
    plan = plan_sync(state_of(data, built(emt)), [absent, emt], SyncOptions(phases=("verify",)))
    assert steps(plan) == [("verify", "emt/emt", "failed last time: synthetic failed")]
    assert "absent: not built, and the build phase is not selected" in plan.notes
    assert any("emt-unfetched" in n and "download phase is not selected" in n for n in plan.notes)


def test_without_the_build_phase_a_changed_source_is_a_note() -> None:
    old = env_file("emt", ["emt"])
    new = env_file("emt", ["emt"], extra="SCALE = 2\n")
    data = manifest((old, {"emt": verified_entry(old)}))
    plan = plan_sync(state_of(data, built(old)), [new], SyncOptions(phases=("download", "verify")))
    assert plan.items == []
    assert plan.notes == [f"emt: {SOURCE_DIFFERS}; not rebuilt (the build phase is not selected)"]


def test_env_and_checkpoint_filters_narrow_the_plan() -> None:
    one = env_file("one", ["one-a", "one-b"])
    two = env_file("two", ["two-a"])
    state = state_of(new_manifest([CLUSTER]))
    by_env = plan_sync(state, [one, two], SyncOptions(envs=frozenset({"two"})))
    assert {i.env for i in by_env.items} == {"two"}
    by_id = plan_sync(state, [one, two], SyncOptions(checkpoints=frozenset({"one-b"})))
    assert steps(by_id) == [
        ("build", "one", NOT_BUILT),
        ("download", "one/one-b", NOT_FETCHED),
        ("verify", "one/one-b", NEWLY_FETCHED),
    ]


def test_without_a_cluster_nothing_is_verified_and_every_variant_is_fetched() -> None:
    gamma = env_file("emt-gamma", ["g-1"], clusters=["gamma"])
    plan = plan_sync(state_of(new_manifest([CLUSTER]), cluster=None), [gamma], SyncOptions())
    assert steps(plan) == [
        ("build", "emt-gamma", NOT_BUILT),
        ("download", "emt-gamma/g-1", NOT_FETCHED),
    ]


def test_items_run_build_then_download_then_verify_across_envs() -> None:
    envs = [env_file(name, [f"{name}-1"]) for name in ("b", "a", "c")]
    plan = plan_sync(state_of(new_manifest([CLUSTER])), envs, SyncOptions())
    assert [i.phase for i in plan.items] == ["build"] * 3 + ["download"] * 3 + ["verify"] * 3
    assert [i.env for i in plan.phase_items("build")] == ["b", "a", "c"]  # SOURCE's order


# --- a file failing the lint ------------------------------------------------------------


def test_a_file_failing_the_lint_is_a_blocked_build_and_the_rest_goes_on() -> None:
    emt = env_file("emt", ["emt"])
    problem = LintProblem(Path("/src/bad.py"), 1, "no setup()", "define it")
    bad = RejectedFile("bad", Path("/src/bad.py"), (problem,))
    plan = plan_sync(state_of(new_manifest([CLUSTER])), [emt], SyncOptions(), [bad])
    first = plan.items[0]
    assert (first.phase, first.env, first.reason, first.symbol) == (
        "build",
        "bad",
        LINT_FAILED,
        "!",
    )
    assert first.blocked == (str(problem),)
    assert [i.env for i in plan.items[1:]] == ["emt", "emt", "emt"]
    without_builds = plan_sync(
        state_of(new_manifest([CLUSTER])), [emt], SyncOptions(phases=("verify",)), [bad]
    )
    assert "bad: /src/bad.py fails the install lint" in without_builds.notes


# --- the --json shape -------------------------------------------------------------------


def test_the_plan_document_shape() -> None:
    emt = env_file("emt", ["emt"])
    doc = plan_sync(state_of(new_manifest([CLUSTER])), [emt], SyncOptions()).to_dict()
    assert set(doc) == {"items", "notes", "counts"}
    assert doc["items"][0] == {
        "phase": "build",
        "env": "emt",
        "checkpoint": None,
        "reason": NOT_BUILT,
        "path": "/src/emt.py",
        "blocked": [],
    }
    assert doc["counts"] == {"build": 1, "download": 1, "verify": 1}


# --- parsing and checking the command line ----------------------------------------------


def test_phases_parse_into_canonical_order() -> None:
    assert parse_phases("verify,build") == ("build", "verify")
    assert parse_phases(" Download ") == ("download",)
    with pytest.raises(UsageError, match="unknown phase 'biuld'"):
        parse_phases("biuld,verify")
    with pytest.raises(UsageError, match="no phase given"):
        parse_phases(",")


def test_unknown_env_and_checkpoint_names_are_usage_errors_with_close_matches() -> None:
    emt = env_file("emt", ["emt", "emt-2"])
    other = env_file("other", ["o-1", "fam:custom"])
    state = state_of(new_manifest([CLUSTER]))
    with pytest.raises(UnknownEnvName, match="close matches: emt") as exc:
        check_scope([emt, other], [], state, SyncOptions(envs=frozenset({"emx"})), "src")
    assert exc.value.exit_code == 2
    with pytest.raises(CheckpointNotDeclared, match="close matches: emt-2"):
        check_scope([emt], [], state, SyncOptions(checkpoints=frozenset({"emt-3"})), "src")
    with pytest.raises(UsageError, match="user-supplied weights"):
        check_scope([other], [], state, SyncOptions(checkpoints=frozenset({"fam:custom"})), "s")
    mismatch = SyncOptions(envs=frozenset({"other"}), checkpoints=frozenset({"emt"}))
    with pytest.raises(UsageError, match="declared by env 'emt', not by other"):
        check_scope([emt, other], [], state, mismatch, "src")


def test_a_rejected_file_and_a_hotfix_added_id_are_known_names() -> None:
    emt = env_file("emt", ["emt"])
    live = env_file("emt", ["emt", "hotfix-id"])
    bad = RejectedFile("bad", Path("/src/bad.py"), ())
    state = state_of(new_manifest([CLUSTER]), built(emt, live=live))
    options = SyncOptions(envs=frozenset({"bad", "emt"}), checkpoints=frozenset({"hotfix-id"}))
    check_scope([emt], [bad], state, options, "src")  # no error


# --- the executor's keep-going rules, with items that start nothing -----------------


def run_plan(tmp_path: Path, items: list[PlanItem], *, fail_fast: bool = False) -> list[ItemResult]:
    """Execute hand-made ``items`` against an empty root: nothing there can start."""
    from rootstock.install.layout import InstallLayout

    source = EnvSource("src", "dir", tmp_path, [])
    prepared = PreparedSync(source, state_of(new_manifest([CLUSTER])), SyncPlan(items), "cpu")
    seen: list[str] = []
    hooks = SyncHooks(on_item_start=lambda item: seen.append(item.key))
    results = execute_plan(
        InstallLayout(tmp_path, tmp_path), prepared, SyncRun(jobs=1, fail_fast=fail_fast), hooks
    )
    # Only items that ran were started; skipped ones never reached their phase.
    assert seen == [r.item.key for r in results if r.status != "skipped"]
    return results


def blocked_build(name: str) -> PlanItem:
    return PlanItem("build", name, None, LINT_FAILED, Path(f"/src/{name}.py"), blocked=("bad",))


def test_a_failed_build_skips_its_env_and_a_failed_download_its_verify(tmp_path: Path) -> None:
    results = run_plan(
        tmp_path,
        [
            blocked_build("bad"),
            PlanItem("download", "bad", "bad-1", NOT_FETCHED),
            PlanItem("download", "gone", "gone-1", NOT_FETCHED),  # not installed: fails
            PlanItem("verify", "bad", "bad-1", NEWLY_FETCHED),
            PlanItem("verify", "gone", "gone-1", NEWLY_FETCHED),
        ],
    )
    outcome = [(r.item.phase, r.item.key, r.status, r.message) for r in results]
    assert outcome[0][:3] == ("build", "bad", "failed")
    assert outcome[0][3] == f"/src/bad.py {LINT_FAILED}" and results[0].output == "bad"
    assert outcome[1] == ("download", "bad/bad-1", "skipped", "the build of bad failed")
    assert outcome[2][:3] == ("download", "gone/gone-1", "failed")
    assert "no env named 'gone' is installed" in (outcome[2][3] or "")
    assert outcome[3] == ("verify", "bad/bad-1", "skipped", "the build of bad failed")
    assert outcome[4] == (
        "verify", "gone/gone-1", "skipped", "the download of gone/gone-1 failed",
    )  # fmt: skip


def test_fail_fast_cancels_what_has_not_started(tmp_path: Path) -> None:
    results = run_plan(
        tmp_path,
        [blocked_build("first"), blocked_build("second"), PlanItem("download", "x", "x-1", "r")],
        fail_fast=True,
    )
    assert [r.status for r in results] == ["failed", "skipped", "skipped"]
    assert results[1].message == "cancelled (--fail-fast: an earlier item failed)"


# --- which cluster the state is read for ------------------------------------------------


def test_verifying_on_a_shared_install_needs_a_cluster(tmp_path: Path) -> None:
    from rootstock.install.layout import InstallLayout, write_layout
    from rootstock.install.manifest import ensure_manifest
    from rootstock.ops.sync import read_install_state

    write_layout(tmp_path, None)
    layout = InstallLayout(tmp_path, tmp_path)
    ensure_manifest(layout, ["alpha", "beta"])
    with pytest.raises(UsageError, match="serves several clusters") as exc:
        read_install_state(layout, None, "cpu", verifying=True)
    assert exc.value.exit_code == 2
    assert read_install_state(layout, None, "cuda:1", verifying=False).cluster is None
    chosen = read_install_state(layout, "Beta", "cuda:1", verifying=True)
    assert (chosen.cluster, chosen.device_kind, dict(chosen.envs)) == ("beta", "gpu", {})


def test_the_run_defaults_are_add_and_verify_defaults() -> None:
    # ops/sync.py copies them so that a no-op sync never imports what builds and verifies.
    from rootstock.ops import add, sync, verify

    assert sync.DEFAULT_VERIFY_TIMEOUT == verify.DEFAULT_VERIFY_TIMEOUT
    assert sync.DEFAULT_DOWNLOAD_TIMEOUT == add.DEFAULT_DOWNLOAD_TIMEOUT
    assert SyncRun().verify_timeout == verify.DEFAULT_VERIFY_TIMEOUT


def test_syncs_default_timeouts_are_adds_and_verifys():
    # ops/sync.py repeats them so that a no-op sync need not import verify and add.
    from rootstock.ops import add, sync, verify

    assert sync.DEFAULT_VERIFY_TIMEOUT == verify.DEFAULT_VERIFY_TIMEOUT
    assert sync.DEFAULT_DOWNLOAD_TIMEOUT == add.DEFAULT_DOWNLOAD_TIMEOUT
