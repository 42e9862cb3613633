"""Usage records from real sessions, under real users (runs as root for those tests).

Sessions run as separate processes under three real accounts (``setpriv
--reuid``), each with its own home, so each record's ``user`` is the random id in
that account's own config dir, as it is on a cluster. The accounts share a project
group, which owns the spool, as after ``setup-perms``. The install lives under
/srv, not under pytest's temp dir: /tmp/pytest-of-root is 0700, so no other
account could reach anything below it.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import random
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rootstock.install.layout import InstallLayout
from rootstock.install.usage import DISABLE_ENV, read_records
from rootstock.install.usage_id import USER_ID_NAME
from rootstock.ops.usage import name_digest, tally_records
from tests.conftest import ROOTSTOCK, make_root, run_rootstock

REPO = Path(__file__).resolve().parents[2]
EMT_ENV = REPO / "environments" / "emt.py"
USERS = ("rsusage1", "rsusage2", "rsusage3")
PROJECT = "rsusageproj"
FORCE_CALLS = 3

pytestmark = pytest.mark.timeout(900)

needs_accounts = pytest.mark.skipif(
    os.geteuid() != 0
    or not all(shutil.which(t) for t in ("setpriv", "useradd", "userdel", "groupadd", "usermod")),
    reason="runs sessions under real accounts: needs root, setpriv, useradd and groupadd",
)

# Each session: a few force calls on a rattled Cu cell, energies printed as JSON.
SESSION = """
import json, sys
from ase.build import bulk
from rootstock import RootstockCalculator
atoms = bulk("Cu", cubic=True).repeat((2, 1, 1))
energies = []
with RootstockCalculator("emt", root=sys.argv[1], device="cpu", timeout=300) as calc:
    atoms.calc = calc
    for i in range(int(sys.argv[2])):
        atoms.positions[0, 0] += 0.01
        energies.append(atoms.get_potential_energy())
print(json.dumps(energies))
"""


def reference_energies(n: int) -> list[float]:
    """The same calculation in-process with ASE's EMT."""
    from ase.build import bulk
    from ase.calculators.emt import EMT

    atoms = bulk("Cu", cubic=True).repeat((2, 1, 1))
    atoms.calc = EMT()
    energies = []
    for _ in range(n):
        atoms.positions[0, 0] += 0.01
        energies.append(atoms.get_potential_energy())
    return energies


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=check)


@pytest.fixture(scope="module")
def accounts() -> Iterator[tuple[str, ...]]:
    """Three ordinary accounts in one project group, created idempotently and removed
    afterwards."""
    _sh("groupadd", "-f", PROJECT)
    for user in USERS:
        try:
            pwd.getpwnam(user)
        except KeyError:
            _sh("useradd", "-m", "-s", "/bin/sh", user)
        _sh("usermod", "-aG", PROJECT, user)
    yield USERS
    for user in USERS:
        _sh("userdel", "-r", user, check=False)
    _sh("groupdel", PROJECT, check=False)


def session_as(user: str, root: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start one calculator session as ``user`` (its own uid, gid and home)."""
    entry = pwd.getpwnam(user)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": entry.pw_dir,
        "USER": user,
        "LOGNAME": user,
        "ROOTSTOCK_CONFIG": f"{entry.pw_dir}/rootstock-config.toml",
        "PYTHONDONTWRITEBYTECODE": "1",
        **(extra_env or {}),
    }
    argv = [
        "setpriv",
        f"--reuid={entry.pw_uid}",
        f"--regid={entry.pw_gid}",
        "--init-groups",
        "--",
        sys.executable,
        "-c",
        SESSION,
        str(root),
        str(FORCE_CALLS),
    ]
    return subprocess.Popen(
        argv,
        env=env,
        cwd="/",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[list[float], str]:
    """Wait for a session; kill its whole group if it hangs."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"session hung:\n{err}") from None
    assert proc.returncode == 0, f"session failed ({proc.returncode}):\n{out}\n{err}"
    return json.loads(out), err


def reset_spool(spool: Path, mode: int = 0o1777) -> Path:
    """An empty spool of the project group's, as setup-perms leaves it."""
    if spool.is_symlink() or spool.is_file():
        spool.unlink()
    elif spool.exists():
        shutil.rmtree(spool)
    spool.mkdir()
    shutil.chown(spool, group=PROJECT)
    os.chmod(spool, mode)
    return spool


@pytest.fixture(scope="module")
def shared_root(accounts, shared_uv_cache: Path, torch_pin) -> Iterator[Path]:
    """An EMT install every account can read, with a 1777 spool; built as root.

    The env is built on /usr/bin/python3: a managed or pyenv interpreter under a
    private directory would be unusable by the other accounts.
    """
    Path("/srv").mkdir(mode=0o755, exist_ok=True)
    base = Path(f"/srv/rootstock-usage-{secrets.token_hex(4)}")
    base.mkdir(mode=0o755)
    try:
        root = make_root(base / "root", shared_uv_cache)
        run_rootstock("install", EMT_ENV, "--root", root, "--python", "/usr/bin/python3")
        reset_spool(root / "usage")
        yield root
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --- real sessions -----------------------------------------------------------------------


@needs_accounts
def test_verification_records_a_verify_session(shared_root: Path):
    spool = reset_spool(shared_root / "usage")
    run_rootstock("add", "emt", "--device", "cpu", "--root", shared_root)
    records, _ = read_records(spool)
    assert [r["entry_point"] for r in records.values()] == ["verify"]
    assert next(iter(records.values()))["force_calls"] >= 1


@needs_accounts
def test_concurrent_sessions_from_three_users(shared_root: Path, accounts):
    spool = reset_spool(shared_root / "usage")
    users = [accounts[i % 3] for i in range(8)]
    procs = [session_as(user, shared_root) for user in users]
    expected = reference_energies(FORCE_CALLS)
    for proc in procs:
        energies, _err = finish(proc)
        assert energies == pytest.approx(expected, abs=1e-9)

    records, unreadable = read_records(spool)
    assert len(records) == 8 and not unreadable
    # Each account's id is the one in its own 0600 file (ROOTSTOCK_CONFIG puts it in
    # its home), three accounts, three ids, however their first sessions raced.
    ids = {}
    for user in accounts:
        id_file = Path(pwd.getpwnam(user).pw_dir) / USER_ID_NAME
        info = id_file.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == pwd.getpwnam(user).pw_uid
        ids[id_file.read_text().strip()] = user
    assert len(ids) == 3
    owners = {pwd.getpwnam(u).pw_uid for u in accounts}
    gid = grp.getgrnam(PROJECT).gr_gid
    for name, record in records.items():
        assert ids[record["user"]] == pwd.getpwuid((spool / name).stat().st_uid).pw_name
        assert record["force_calls"] == FORCE_CALLS
        assert (record["entry_point"], record["env"], record["checkpoint"]) == (
            "calculator",
            "emt",
            "emt",
        )
        info = (spool / name).stat()
        assert stat.S_IMODE(info.st_mode) == 0o640 and info.st_uid in owners
        assert info.st_gid == gid
    # No username anywhere in the spool, and no salt to hash usernames with.
    assert sorted(p.name for p in spool.iterdir()) == sorted(records)
    for path in spool.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            assert not any(user in text for user in accounts), path

    report = json.loads(run_rootstock("usage", "report", "--json", "--root", shared_root).stdout)
    assert report["totals"] == {"users": 3, "sessions": 8, "force_calls": 8 * FORCE_CALLS}
    assert [(r["env"], r["checkpoint"], r["users"]) for r in report["rows"]] == [("emt", "emt", 3)]
    table = run_rootstock("usage", "report", "--root", shared_root).stdout
    assert "emt" in table and "total" in table


@needs_accounts
@pytest.mark.parametrize("case", ["opt-out", "read-only", "missing", "dangling-link"])
def test_spool_problems_record_nothing_and_break_nothing(shared_root: Path, accounts, case):
    spool = shared_root / "usage"
    extra = {}
    if case == "opt-out":
        reset_spool(spool)
        extra = {DISABLE_ENV: "1"}
    elif case == "read-only":
        reset_spool(spool, mode=0o755)  # root's directory: the user cannot write in it
    elif case == "missing":
        shutil.rmtree(spool)
    else:
        shutil.rmtree(spool)
        spool.symlink_to(shared_root / "no-such-spool")
    try:
        energies, err = finish(session_as(accounts[0], shared_root, extra))
        assert energies == pytest.approx(reference_energies(FORCE_CALLS), abs=1e-9)
        assert "usage" not in err.lower() and "salt" not in err.lower()
        if spool.is_dir():
            assert read_records(spool) == ({}, [])
            assert list(spool.iterdir()) == []
        else:
            assert not (shared_root / "no-such-spool").exists()
    finally:
        reset_spool(spool)


@needs_accounts
def test_an_account_that_cannot_keep_its_id_still_records_untraceably(shared_root, accounts):
    spool = reset_spool(shared_root / "usage")
    # The config dir would be /rootstock-usage-ro: the account cannot create it.
    nowhere = {"ROOTSTOCK_CONFIG": "/rootstock-usage-ro/config.toml"}
    for proc in [session_as(accounts[0], shared_root, nowhere) for _ in range(2)]:
        energies, err = finish(proc)
        assert energies == pytest.approx(reference_energies(FORCE_CALLS), abs=1e-9)
        assert "usage" not in err.lower()
    assert not Path("/rootstock-usage-ro").exists()
    records, unreadable = read_records(spool)
    users = {r["user"] for r in records.values()}
    assert len(records) == 2 and not unreadable
    assert len(users) == 2  # one random id per process, never the account's own
    own = Path(pwd.getpwnam(accounts[0]).pw_dir) / USER_ID_NAME
    if own.exists():
        assert own.read_text().strip() not in users


# --- compact under SIGKILL ---------------------------------------------------------------


def synthetic_spool(
    spool: Path, count: int, batch: int = 0, names: list[str] | None = None
) -> list[dict]:
    """``count`` records over three months, two envs and five users; returns them.

    Their file names are appended to ``names`` when given.
    """
    rng = random.Random(batch)
    records = []
    for i in range(count):
        record = {
            "version": 1,
            "env": rng.choice(["emt", "mace"]),
            "checkpoint": rng.choice(["emt", "(local)"]),
            "device": "cpu",
            "entry_point": "calculator",
            "start": f"2026-{rng.choice(['09', '10', '11'])}-0{rng.randint(1, 9)}T10:00:00Z",
            "duration_s": 1.0,
            "force_calls": rng.randint(0, 50),
            "user": f"hash{rng.randint(0, 4)}",
        }
        name = f"20261101T000000Z-{batch:02d}{i:06d}.json"
        (spool / name).write_text(json.dumps(record))
        records.append(record)
        if names is not None:
            names.append(name)
    return records


def expected_report(records: list[dict]) -> dict:
    """The report's rows and totals, computed independently of the spool."""
    tallies = tally_records(records)
    rows = [
        {
            "month": month,
            "env": env,
            "checkpoint": checkpoint,
            "users": len(t.users),
            "sessions": t.sessions,
            "force_calls": t.force_calls,
        }
        for (month, env, checkpoint), t in sorted(tallies.items())
    ]
    users = set().union(*(t.users for t in tallies.values()))
    return {
        "rows": rows,
        "totals": {
            "users": len(users),
            "sessions": len(records),
            "force_calls": sum(r["force_calls"] for r in records),
        },
    }


def test_compact_killed_mid_run_keeps_totals(tmp_path: Path):
    """SIGKILL at random moments inside compact; every report in between is exact."""
    count = 20000

    def make_spool(name: str) -> tuple[Path, tuple[str, ...]]:
        layout = InstallLayout(tmp_path / name, tmp_path / name)
        layout.usage_dir.mkdir(parents=True)
        return layout.usage_dir, ("--root", str(layout.root))

    def compact_cmd(args: tuple[str, ...]) -> subprocess.Popen:
        return subprocess.Popen(
            [*ROOTSTOCK, "usage", "compact", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    # How long one whole compact takes here, so the kills land inside it.
    calibration_spool, calibration = make_spool("calibration")
    synthetic_spool(calibration_spool, count)
    began = time.monotonic()
    assert compact_cmd(calibration).wait(timeout=300) == 0
    full = time.monotonic() - began

    spool, args = make_spool("root")

    def totals() -> dict:
        report = json.loads(run_rootstock("usage", "report", "--json", *args).stdout)
        return {"rows": report["rows"], "totals": report["totals"]}

    def rollup_inodes() -> set[tuple[str, int, int]]:
        found = set()
        for path in (spool / "rollups").glob("*.json"):
            with contextlib.suppress(FileNotFoundError):
                st = path.stat()
                found.add((path.name, st.st_ino, st.st_mtime_ns))
        return found

    def after_a_rollup_write(proc: subprocess.Popen) -> None:
        """Return once ``proc`` has (re)written a rollup, or has exited."""
        before = rollup_inodes()
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if rollup_inodes() - before:
                return
            time.sleep(0.001)

    generated: list[dict] = []
    names: list[str] = []
    rng = random.Random()
    interrupted = 0
    for batch in range(12):
        if not any(spool.glob("*.json")):  # nothing left to fold: give it more work
            generated += synthetic_spool(spool, count, batch, names)
        proc = compact_cmd(args)
        if batch % 2:
            # Aimed at the hard case: a rollup is durable and deletions have begun.
            # (Timed kills alone can miss it on a loaded machine.)
            after_a_rollup_write(proc)
        else:
            time.sleep(rng.uniform(0.4, 1.0) * full)
        # A compact that finished before the kill (a fast turn) has nothing to kill.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert totals() == expected_report(generated)
        left = any(spool.glob("*.json"))
        # Killed between a durable rollup and the last deletion: the hard case.
        interrupted += left and any((spool / "rollups").glob("*.json"))
        if interrupted >= 3:
            break
    assert interrupted, f"no kill landed after a rollup write in a {full:.2f} s compact"
    run_rootstock("usage", "compact", *args)
    assert totals() == expected_report(generated)
    assert not list(spool.glob("*.json"))  # every record folded and deleted
    run_rootstock("usage", "compact", *args)  # a re-run on a clean spool changes nothing
    assert totals() == expected_report(generated)
    rollups = sorted(p.name for p in (spool / "rollups").glob("*.json"))
    assert rollups == ["2026-09.json", "2026-10.json", "2026-11.json"]
    # Schema 2: counts and a digest, no names once settled; each name folded exactly
    # once however the kills fell (digests add up across months: a sum of hashes).
    bodies = [json.loads((spool / "rollups" / name).read_text()) for name in rollups]
    assert all(b["version"] == 2 and b["pending"] == [] and "folded" not in b for b in bodies)
    assert sum(b["folded_count"] for b in bodies) == len(generated) == len(names)
    digest = sum(int(b["folded_digest"], 16) for b in bodies) % (1 << 256)
    assert digest == name_digest(names)
    assert all((spool / "rollups" / name).stat().st_size < 4096 for name in rollups)
