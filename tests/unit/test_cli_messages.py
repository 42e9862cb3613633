"""Messages that say what to do, in the caller's terms, once (issue #31, item 4).

The commands run in-process through ``rootstock.cli.main.main``. The envs here are
FAKES (an ``env_source.py`` copied into ``envs/NAME/`` with no interpreter): every
message tested comes before anything would run in one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rootstock.cli.main import main
from rootstock.errors import RootNotFound
from rootstock.install.envfile import source_hash
from rootstock.install.machine import resolve_layout, resolve_root
from rootstock.ops.init import InitRequest, init_root
from rootstock.ops.install import InstallOutcome
from rootstock.ops.workers import PooledWorker
from rootstock.runtime.calculator import RootstockCalculator

pytestmark = pytest.mark.timeout(60)

SAMPLE_EMT = Path(__file__).resolve().parents[2] / "environments" / "emt.py"


@pytest.fixture(autouse=True)
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user with no root anywhere: an empty config, no $ROOTSTOCK_ROOT, no registry."""
    config = tmp_path / "user" / "config.toml"
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(config))
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    return config


def run_cli(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    """Run one rootstock command in-process; return (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def make_install(root: Path, cluster: str = "demo", checkpoints: str | None = None) -> Path:
    """An initialised root with a FAKE built emt env, registered as installed.

    ``checkpoints`` replaces the sample's ``CHECKPOINTS`` line (longer ids).
    """
    init_root(InitRequest(root=root, cluster=cluster))
    text = SAMPLE_EMT.read_text()
    if checkpoints is not None:
        text = text.replace('    "emt": "ase.calculators.emt.EMT",\n', checkpoints)
    env_dir = root / "envs" / "emt"
    env_dir.mkdir(parents=True)
    (env_dir / "env_source.py").write_text(text)
    (env_dir / "rootstock-env.json").write_text(json.dumps({"source_hash": source_hash(text)}))
    (root / "environments").mkdir(exist_ok=True)
    (root / "environments" / "emt.py").write_text(text)
    return root


# --- a RootNotFound speaks Python to Python, options to the CLI ----------------------


def test_no_root_from_python_names_the_keywords_and_from_the_cli_the_options(capsys):
    with pytest.raises(RootNotFound) as info:
        resolve_root()
    assert "pass root=PATH or cluster=NAME, set $ROOTSTOCK_ROOT" in str(info.value)
    assert "--root" not in str(info.value) and "--cluster" not in str(info.value)
    with pytest.raises(RootNotFound) as info:
        RootstockCalculator(checkpoint="emt", device="cpu")
    assert "root=PATH or cluster=NAME" in str(info.value)

    code, _, err = run_cli(capsys, "status")
    assert code == 1
    assert "hint: pass --root PATH or --cluster NAME, set $ROOTSTOCK_ROOT" in err
    assert "root=" not in err


def test_a_missing_root_from_python_says_root_keyword(tmp_path, capsys):
    with pytest.raises(RootNotFound) as info:
        resolve_layout(tmp_path / "absent")
    assert str(info.value).endswith("or pass the right root=")
    code, _, err = run_cli(capsys, "status", "--root", tmp_path / "absent")
    assert code == 1 and err.rstrip().endswith("or pass the right --root")


# --- --cluster chose a root that does not exist ----------------------------------------


def test_a_missing_registry_root_says_cluster_chose_it_and_root_picks_another(
    tmp_path, user, capsys, monkeypatch
):
    mine = make_install(tmp_path / "mine")
    user.write_text(f'root = "{mine}"\n')
    absent = tmp_path / "registry-root"
    registry = tmp_path / "user" / "clusters.toml"
    registry.write_text(f'[clusters.delta]\nroot = "{absent}"\n')
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(registry))

    code, _, err = run_cli(capsys, "status", "--cluster", "delta")
    assert code == 1
    assert err.startswith(f"error: install root {absent} does not exist\n")
    hint = err.split("hint: ", 1)[1]
    assert hint.startswith("--cluster delta chose it (the cluster registry's root for it")
    assert f"pass --root PATH to use another install (config ({user}) names {mine})" in hint
    assert f"or create this one with `rootstock init --root {absent}`" in hint

    with pytest.raises(RootNotFound) as info:
        RootstockCalculator(cluster="delta", checkpoint="emt", device="cpu")
    assert info.value.hint is not None
    assert info.value.hint.startswith("cluster='delta' chose it")
    assert "pass root=PATH to use another install" in info.value.hint


# --- sync --dry-run names the SOURCE it used -------------------------------------------


def test_a_converged_dry_run_without_source_names_the_registered_env_files(tmp_path, capsys):
    root = make_install(tmp_path / "root")
    code, out, err = run_cli(
        capsys, "sync", "--root", root, "--dry-run", "--phases", "build", "--device", "cpu"
    )
    assert code == 0, err
    assert out.splitlines()[-1] == (
        f"Plan: nothing to do; the install matches registered sources in {root / 'environments'}."
    )


# --- manifest init that adds a cluster says what changed ------------------------------


def test_adding_a_second_cluster_says_so_and_that_commands_now_need_cluster(tmp_path, capsys):
    root = make_install(tmp_path / "root", cluster="demo")
    code, out, err = run_cli(
        capsys, "manifest", "init", "--root", root, "--cluster", "delta", "--no-push"
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"updated {root / 'manifest.json'}: added delta; clusters: demo, delta"
    assert lines[1].startswith("note: this install now serves 2 clusters, so `add`, `smoke-test`")
    assert "need --cluster NAME (demo, delta)" in lines[1]
    # Again: nothing changes, and nothing new is said.
    code, out, _ = run_cli(
        capsys, "manifest", "init", "--root", root, "--cluster", "delta", "--no-push"
    )
    assert code == 0
    assert out.splitlines() == [f"updated {root / 'manifest.json'}; clusters: demo, delta"]
    # What the note says is so.
    code, _, err = run_cli(capsys, "add", "emt", "--root", root, "--no-push", "--no-perm-check")
    assert code == 2 and "pass --cluster NAME" in err


# --- serve refuses at once without --structure -----------------------------------------


def test_serve_without_a_structure_exits_2_before_starting_a_worker(tmp_path, capsys):
    root = make_install(tmp_path / "root")
    socket = tmp_path / "ipi.sock"
    code, _, err = run_cli(capsys, "serve", "emt", "--socket", socket, "--root", root)
    assert code == 2, err
    assert err.startswith("error: no --structure: a standard i-PI server sends no species")
    assert "hint: pass --structure FILE" in err
    assert "warning" not in err
    # The fake env has no interpreter: getting as far as the spawn would say so instead.
    assert "interpreter" not in err


# --- install says each note once, unwrapped --------------------------------------------

NOTE = (
    "uv-managed Python downloads failed recently; using a local interpreter "
    "(delete /some/root/.python/.downloads-unavailable.json to retry the download)"
)


def test_an_interpreter_note_is_printed_once_on_one_line(tmp_path, capsys, monkeypatch):
    root = make_install(tmp_path / "root")
    env_file = tmp_path / "tiny.py"
    shutil.copyfile(SAMPLE_EMT, env_file)

    def install(layout, target, *, step, **_kw):
        # As ops.install.install_one reports it: a step, and a note of the outcome.
        step(f"tiny: {NOTE}")
        return [InstallOutcome("tiny", "unchanged", notes=["a build warning"], reported=[NOTE])]

    monkeypatch.setattr("rootstock.ops.install.install", install)
    code, _, err = run_cli(capsys, "install", env_file, "--root", root, "--no-perm-check")
    assert code == 0, err
    assert err.count("downloads failed recently") == 1, err
    assert f"tiny: {NOTE}\n" in err  # one line, though longer than COLUMNS=80
    assert "tiny: a build warning" in err


# --- tables never cut what a user copies ------------------------------------------------


def pooled(worker_id: str, checkpoint: str) -> PooledWorker:
    return PooledWorker(
        id=worker_id,
        checkpoint=checkpoint,
        env="mace",
        device="cuda:0",
        root="/shared/rootstock",
        daemon_pid=1234567,
        worker_pid=1234568,
        clients=2,
        started="2026-12-06T00:20:55+00:00",
        idle_timeout=900.0,
        stale=False,
        socket="/run/user/1000/rootstock/x.sock",
        log="/run/user/1000/rootstock/x.log",
    )


def test_workers_list_at_80_columns_shows_whole_ids(capsys, monkeypatch):
    workers = [
        pooled("07102aa3f9c1e2d4", "mace-mp-0-medium-omat-long"),
        pooled("9f3e5c1d2b4a6e8f", "emt"),
    ]
    monkeypatch.setattr("rootstock.ops.workers.list_workers", lambda: workers)
    code, out, err = run_cli(capsys, "workers", "list")
    assert code == 0, err
    assert "…" not in out
    for worker in workers:
        assert worker.id in out and worker.checkpoint in out
        assert str(worker.daemon_pid) in out


def test_status_at_80_columns_keeps_paths_ids_and_labels_whole(tmp_path, capsys):
    deep = tmp_path / ("a-rather-long-directory-name-" * 3) / "rootstock-install-root"
    long_id = "emt-with-a-checkpoint-id-as-long-as-real-ones-are"
    root = make_install(
        deep, cluster="demo", checkpoints=f'    "{long_id}": "ase.calculators.emt.EMT",\n'
    )
    code, out, err = run_cli(capsys, "status", "--root", root)
    assert code == 0, err
    assert "…" not in out
    lines = out.splitlines()
    assert lines[:3] == [f"root: {root}", f"cache root: {root}", "clusters: demo"]
    assert any(long_id in line for line in lines), out
    # list: the same id, and the root in the table's title.
    code, out, err = run_cli(capsys, "list", "--root", root)
    assert code == 0, err
    assert "…" not in out
    assert out.splitlines()[0].strip() == f"envs in {root}"
    assert long_id in out
