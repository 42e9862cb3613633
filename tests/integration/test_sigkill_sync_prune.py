"""SIGKILL ``sync`` and ``prune`` at random moments; the install must stay valid.

Issue #15: "10 random SIGKILLs of each command, each followed by the checks above".
Both campaigns run on one private root (the sample EMT env plus a derived ``twin``
whose ``download()`` fetches a weights file from a loopback server), with a
*private* uv cache, because ``prune`` runs ``uv cache prune``. Every trial starts
from a state where the command has real work, re-created before each trial by
``prepare`` (see :mod:`tests.integration.kill_campaign`):

* ``sync``: ``twin``'s env file is rewritten with two new checkpoint ids, so each run
  rebuilds ``twin`` (real uv), downloads two checkpoints (workers) and verifies them
  (``--verify-jobs 2``: two workers at once). Half the kills are drawn from the
  whole run, half from the moment the build is done, so they land mid-build,
  mid-download and mid-verification.
* ``prune``: before each trial, a checkpoint of the built env ``shards`` that
  SOURCE no longer declares is fetched (its download brings ``SHARD_FILES``
  attributed files, and rewrites one file, ``common.bin``, that the declared
  ``shards-keep`` also owns); every fourth trial an env ``gone-N`` that SOURCE does
  not declare is built (real uv) unless a killed prune left one; and garbage is
  made: old hard-linked copies of ``emt``'s generation, an ownerless ``.build/``
  staging entry two days old and a lockfile without a source. Half the kills are
  drawn from the moment it starts dropping records, so they land mid-transaction,
  mid-deletion or in ``uv cache prune``, the others mostly while it plans.

After each campaign, besides the common checks (no process alive 5 s after a kill;
the manifest parses; ``status --json`` exits 0; ``check-perms`` finds nothing new;
the next run exits 0 and leaves no run dir, staging, stray generation, trash or
journal): the next ``sync`` has converged (its dry run plans nothing, the newest
ids are verified); the next ``prune`` has removed every ``gone-N`` (env, records,
registered files, attributed files) and every undeclared ``shards`` record with its
files, and kept ``emt``, ``twin`` and ``shards-keep`` whole (``common.bin`` too).

Each campaign kills 6 times in CI, half of them after its mark (issue #15 asked for
10: ``scripts/soak`` runs 20 or more); ``ROOTSTOCK_SIGKILL_TRIALS`` and
``ROOTSTOCK_SIGKILL_SEED`` override the count and the seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rootstock.install.generations import GENERATION_LOCK, make_generation_lock
from tests.conftest import ENVIRONMENTS, copy_env, make_root, run_rootstock
from tests.integration.checkpoint_envs import (
    DOWNLOAD_HOOKS,
    PLAIN_SETUP,
    WeightsServer,
    cells,
    weights_server,
    write_env,
)
from tests.integration.kill_campaign import (
    Campaign,
    campaign_timeout_s,
    run_campaign,
    run_tmpdir,
    trials_from_env,
)
from tests.run_cache import link_live_tree

pytestmark = [pytest.mark.timeout(campaign_timeout_s()), pytest.mark.usefixtures("private_config")]

__all__ = ["run_tmpdir"]  # a fixture: imported so that pytest finds it here

TRIALS = trials_from_env()
SHARD_FILES = 500
OLD_GENERATIONS = 2
GONE_EVERY = 4
TWO_DAYS_S = 2 * 24 * 3600.0

# download() writes SHARD_FILES small files under the cache root, and replaces
# common.bin (a new inode: the scan attributes it to every checkpoint fetched), so
# each record lists its own shards plus the shared file.
MANY_FILES_DOWNLOAD = f'''

def download(checkpoint, **kw):
    """Write {SHARD_FILES} weight shards under the cache root, and the shared common.bin."""
    import os

    top = os.path.join(os.environ["XDG_CACHE_HOME"], "shard-weights")
    base = os.path.join(top, checkpoint)
    os.makedirs(base, exist_ok=True)
    for index in range({SHARD_FILES}):
        with open(os.path.join(base, f"shard-{{index:05d}}.bin"), "wb") as fh:
            fh.write(os.urandom(512))
    with open(os.path.join(top, "common.bin.part"), "wb") as fh:
        fh.write(b"shared by every shards checkpoint")
    os.replace(os.path.join(top, "common.bin.part"), os.path.join(top, "common.bin"))
    return base
'''
SHARDS_BODY = MANY_FILES_DOWNLOAD + PLAIN_SETUP


@dataclass
class KillRoot:
    """The campaigns' install: its root, the SOURCE directory, where gone-N files live."""

    root: Path
    sources: Path
    gone_dir: Path
    weights: WeightsServer


@pytest.fixture(scope="module")
def weights() -> Iterator[WeightsServer]:
    with weights_server(1.0) as server:
        yield server


@pytest.fixture(scope="module")
def kill_root(tmp_path_factory, shared_uv_cache: Path, weights: WeightsServer) -> KillRoot:
    """EMT (fetched and verified) and ``twin`` v0 built, with a private uv cache.

    The private cache is a hard-linked copy of the session's: ``uv cache prune``
    unlinks entries here without touching the shared files, and builds stay warm.
    """
    base = tmp_path_factory.mktemp("sigkill-sync-prune")
    path = base / "root"
    path.mkdir()
    if any(shared_uv_cache.iterdir()):
        link_live_tree(shared_uv_cache, path / ".uv-cache")
    else:
        (path / ".uv-cache").mkdir()
    # make_root links the shared cache only where no .uv-cache exists yet.
    root = make_root(path, shared_uv_cache)
    assert not (root / ".uv-cache").is_symlink()
    sources = base / "env-files"
    copy_env(ENVIRONMENTS / "emt.py", sources)
    write_twin(sources, weights, 0)
    run_rootstock("install", sources, "--root", root, "--no-push", timeout=900)
    run_rootstock("add", "emt", "--root", root, "--device", "cpu", "--no-push")
    return KillRoot(root, sources, base / "gone-env-files", weights)


def write_twin(sources: Path, weights: WeightsServer, generation: int) -> list[str]:
    """Rewrite ``twin.py`` to declare two ids of its own; return them."""
    ids = [f"twin-{generation}-a", f"twin-{generation}-b"]
    write_env(sources, "twin", ids, body=DOWNLOAD_HOOKS.format(url=weights.url))
    return ids


def manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def test_sigkill_sync(kill_root: KillRoot, run_tmpdir: Path, tmp_path: Path):
    """``sync`` killed mid-build, mid-download or mid-verification; the next one converges."""
    k = kill_root
    declared: list[str] = []

    def prepare(index: int) -> None:
        declared[:] = write_twin(k.sources, k.weights, index + 1)

    def converged() -> list[str]:
        problems = []
        plan = run_rootstock(
            "sync", k.sources, "--root", k.root, "--device", "cpu", "--dry-run", "--json",
            check=False, timeout=120,
        )  # fmt: skip
        if plan.returncode != 0:
            return [f"sync --dry-run after the next sync exited {plan.returncode}:\n{plan.stderr}"]
        items = json.loads(plan.stdout)["plan"]["items"]
        if items:
            problems.append(f"the next sync did not converge; still planned: {items}")
        states = cells(k.root)
        for checkpoint in ["emt", *declared]:
            env = "emt" if checkpoint == "emt" else "twin"
            state = states.get((env, checkpoint), {}).get("testbox", {}).get("state")
            if state != "verified":
                problems.append(f"{checkpoint} is {state!r} after the next sync, not verified")
        return problems

    args = [
        "sync", str(k.sources), "--root", str(k.root), "--device", "cpu", "--verify-jobs", "2",
        "--no-push",
    ]  # fmt: skip
    run_campaign(
        Campaign(
            "sync",
            args,
            k.root,
            run_tmpdir,
            tmp_path,
            trials=TRIALS,
            prepare=prepare,
            after_next=converged,
            stays=is_generation,
            perms=True,
            late_mark="ok   build twin",
        )
    )


def is_generation(entry: str) -> bool:
    """``envs/.<name>.<build-id>``: sync keeps replaced generations (prune collects them)."""
    area, _, name = entry.partition("/")
    return area == "envs" and name.startswith(".") and ".link-" not in name


def test_sigkill_prune(kill_root: KillRoot, run_tmpdir: Path, tmp_path: Path):
    """``prune`` killed mid-journal or mid-deletion; the next one finishes what it owed."""
    k = kill_root
    shard_ids = [f"shards-{i}" for i in range(TRIALS + 1)]
    built = write_env(tmp_path / "built", "shards", ["shards-keep", *shard_ids], body=SHARDS_BODY)
    run_rootstock("install", built, "--root", k.root, "--no-push", timeout=600)
    fetch(k.root, "shards-keep")
    # SOURCE: emt and twin as they are, shards with only shards-keep still declared.
    source = tmp_path / "declared"
    for name in ("emt.py", "twin.py"):
        copy_env(k.sources / name, source)
    write_env(source, "shards", ["shards-keep"], body=SHARDS_BODY)
    args = ["prune", str(source), "--root", str(k.root), "--min-age", "0", "--yes"]
    # What only a first prune finds (the sync campaign's old twin ids and generations,
    # unused uv cache entries) must not stretch the duration the kills are drawn from.
    run_rootstock(*args, timeout=300)

    # Each trial tops the work up to the same amount (a killed prune leaves some of
    # it), so a later trial does not spend the kill window planning a growing pile.
    def prepare(index: int) -> None:
        envs = manifest(k.root)["envs"]
        if all(c == "shards-keep" for c in envs["shards"]["checkpoints"]):
            fetch(k.root, shard_ids[index])
        if index % GONE_EVERY == 1 and not any(name.startswith("gone-") for name in envs):
            make_gone_env(k, index)
        make_garbage(k.root, index)

    def finished() -> list[str]:
        return pruned_everything(k.root) + kept_declared(k.root)

    run_campaign(
        Campaign(
            "prune",
            args,
            k.root,
            run_tmpdir,
            tmp_path,
            trials=TRIALS,
            prepare=prepare,
            after_next=finished,
            perms=True,
            late_mark="dropping the records",
        )
    )


def fetch(root: Path, checkpoint: str) -> None:
    """``add --no-verify``: the download alone, and its files attributed."""
    run_rootstock("add", checkpoint, "--root", root, "--no-verify", "--no-push", timeout=300)
    env = checkpoint.rsplit("-", 1)[0] if checkpoint.startswith("gone-") else "shards"
    record = manifest(root)["envs"][env]["checkpoints"][checkpoint]
    assert len(record.get("files") or []) > SHARD_FILES, f"add did not attribute {checkpoint}"


def make_gone_env(k: KillRoot, index: int) -> None:
    """Build ``gone-<index>`` (real uv), which SOURCE never declares, and fetch its id."""
    name = f"gone-{index}"
    env_file = write_env(k.gone_dir, name, [f"{name}-a"], body=SHARDS_BODY)
    run_rootstock("install", env_file, "--root", k.root, "--no-push", timeout=600)
    fetch(k.root, f"{name}-a")


def make_garbage(root: Path, index: int) -> None:
    """Old copies of emt's live generation, stale staging, a lockfile without a source.

    Only what is missing: OLD_GENERATIONS copies, one staging entry, one lockfile.
    """
    live = (root / "envs" / "emt").resolve()
    past = time.time() - TWO_DAYS_S
    copies = list((root / "envs").glob(".emt.1600000000-kill*"))
    for copy in range(OLD_GENERATIONS - len(copies)):
        old = root / "envs" / f".emt.1600000000-kill{index:02d}{copy}"
        # Hard links: quick to make, as many entries to delete as a real build.
        subprocess.run(["cp", "-al", str(live), str(old)], check=True)
        # A lock file of its own: the hard link would share the live generation's.
        (old / GENERATION_LOCK).unlink(missing_ok=True)
        make_generation_lock(old)
        os.utime(old, (past, past))
    if not list((root / ".build").glob("ghost-*")):
        staging = root / ".build" / f"ghost-{index}.1600000000-dead{index:02d}"
        (staging / "lib").mkdir(parents=True)
        for n in range(50):
            (staging / "lib" / f"mod{n}.py").write_text("x = 1\n")
        for path in (staging / "lib", staging):
            os.utime(path, (past, past))
    if not list((root / "environments").glob("orphan-*")):
        orphan = root / "environments" / f"orphan-{index}.py.lock"
        orphan.write_text("version = 1\n")
        os.utime(orphan, (past, past))


def pruned_everything(root: Path) -> list[str]:
    """Whatever the next prune left of a ``gone-N`` env, an undeclared id, the garbage."""
    problems = []
    envs = manifest(root)["envs"]
    left = sorted(name for name in envs if name.startswith("gone-"))
    left += sorted(c for c in envs["shards"]["checkpoints"] if c != "shards-keep")
    if left:
        problems.append(f"records that SOURCE does not declare remain: {left}")
    stray = sorted(
        str(p.relative_to(root))
        for pattern in ("envs/gone-*", "environments/gone-*", "environments/orphan-*")
        for p in root.glob(pattern)
    )
    # Files only: prune deletes the files a record lists, not the directories they
    # leave empty.
    weights = root / "cache" / "shard-weights"
    stray += sorted(
        str(p.relative_to(root))
        for p in weights.rglob("*")
        if p.is_file() and p.parent.name != "shards-keep" and p.name != "common.bin"
    )
    if stray:
        problems.append(f"left after the next prune: {stray}")
    return problems


def kept_declared(root: Path) -> list[str]:
    """What SOURCE declares comes through every prune: envs built, records, their files."""
    problems = []
    for name in ("emt", "twin", "shards"):
        if not (root / "envs" / name / "rootstock-env.json").is_file():
            problems.append(f"the declared env {name} is no longer built")
    state = cells(root).get(("emt", "emt"), {}).get("testbox", {}).get("state")
    if state != "verified":
        problems.append(f"emt is {state!r} after the prunes, not verified")
    record = manifest(root)["envs"]["shards"]["checkpoints"].get("shards-keep") or {}
    files = record.get("files") or []
    missing = [f for f in files if not (root / f).is_file()]
    if len(files) <= SHARD_FILES or missing:
        problems.append(
            f"shards-keep lost files ({len(files)} recorded, missing {missing[:3]}); "
            "common.bin is shared with the pruned ids and must stay"
        )
    return problems
