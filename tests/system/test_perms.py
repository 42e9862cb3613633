"""Shared-install permissions with real users, groups and ACLs (runs as root).

Three accounts are created for the module and removed afterwards: a maintainer
and a second member of a project group, and an outsider in neither. The
maintainer applies ``setup-perms`` and builds the sample EMT env with a umask of
077, then the other two use the install. The outsider computing an EMT energy
through ``RootstockCalculator`` is the seed's functional test: the account that
does not own the tree and is not in its group is the only one whose access proves
the contract, because owner bits and group ACLs mask everything for the others.

Trees live under /srv, not under pytest's temp dir: /tmp/pytest-of-root is 0700,
so nobody else could reach anything below it.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from rootstock.install.layout import InstallLayout
from rootstock.install.perms import build_recipe

REPO = Path(__file__).resolve().parents[2]
AUDIT = REPO / "scripts" / "check_world_readable.sh"
EMT_ENV = REPO / "environments" / "emt.py"

MAINT, MEMBER, OUTSIDER, PROJECT = "rstest-maint", "rstest-member", "rstest-outsider", "rstest-proj"
#: Where the accounts' workers stage builds (each user's 0700 directory is made in it);
#: sticky and world-writable, like /tmp, and removed with the accounts.
STAGES = Path(f"/srv/rootstock-test-stages-{secrets.token_hex(4)}")

_TOOLS = ("setfacl", "getfacl", "setpriv", "useradd", "groupadd")
_missing = [tool for tool in _TOOLS if not shutil.which(tool)]
pytestmark = [
    pytest.mark.system,
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0, reason="creates users and groups: needs root"),
    pytest.mark.skipif(
        bool(_missing),
        reason=f"needs {', '.join(_missing)} (apt-get install -y acl util-linux passwd)",
    ),
]

# Settings a user's process needs from ours: certificates, proxies, package indexes.
_PASSED_ON = ("LANG", "LC_ALL", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE")


# --- accounts and running as them ----------------------------------------------------


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=check)


@pytest.fixture(scope="module")
def accounts() -> Iterator[None]:
    """The project group, its two members and the outsider; created idempotently."""
    _sh("groupadd", "-f", PROJECT)
    for user, groups in ((MAINT, PROJECT), (MEMBER, PROJECT), (OUTSIDER, None)):
        try:
            pwd.getpwnam(user)
        except KeyError:
            _sh("useradd", "-m", "-s", "/bin/sh", user)
        if groups:
            _sh("usermod", "-aG", groups, user)
    STAGES.mkdir(parents=True, exist_ok=True)
    os.chmod(STAGES, 0o1777)
    yield
    shutil.rmtree(STAGES, ignore_errors=True)
    for user in (MAINT, MEMBER, OUTSIDER):
        _sh("userdel", "-r", user, check=False)
    _sh("groupdel", PROJECT, check=False)


def _user_env(user: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    home = pwd.getpwnam(user).pw_dir
    env = {k: v for k, v in os.environ.items() if k in _PASSED_ON or k.startswith("UV_")}
    env.update({k: v for k, v in os.environ.items() if k.lower().endswith("_proxy")})
    env.update(
        PATH="/usr/local/bin:/usr/bin:/bin",
        HOME=home,
        USER=user,
        LOGNAME=user,
        ROOTSTOCK_CONFIG=f"{home}/rootstock-config.toml",
        ROOTSTOCK_STAGE_DIR=str(STAGES),
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.update(extra or {})
    return env


def as_user(
    user: str, *argv: str | Path, umask: str = "002", check: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``argv`` as ``user`` with that user's groups, umask and home."""
    entry = pwd.getpwnam(user)
    proc = subprocess.run(
        [
            "setpriv",
            f"--reuid={entry.pw_uid}",
            f"--regid={entry.pw_gid}",
            "--init-groups",
            "--",
            "/bin/sh",
            "-c",
            f'umask {umask} && exec "$@"',
            "sh",
            *map(str, argv),
        ],
        env=_user_env(user),
        cwd="/",
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"as {user}: {' '.join(map(str, argv))} failed ({proc.returncode}):\n"
            f"{proc.stdout}\n{proc.stderr}"
        )
    return proc


def _uv() -> str:
    from uv import find_uv_bin

    return find_uv_bin()


@pytest.fixture(scope="module")
def base(accounts) -> Iterator[Path]:
    """A project directory every user can traverse, writable by the project group."""
    Path("/srv").mkdir(mode=0o755, exist_ok=True)
    path = Path(f"/srv/rootstock-test-{secrets.token_hex(4)}")
    path.mkdir(mode=0o755)
    shutil.chown(path, group=PROJECT)
    os.chmod(path, 0o2775)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def client_python(base: Path) -> str:
    """A Python with rootstock that the other accounts can run.

    The dev venv works when it is built on a system Python in a world-readable
    checkout; otherwise (e.g. a venv on a pyenv Python under /root) a fresh venv on
    Debian's /usr/bin/python3 gets rootstock installed from this checkout.
    """
    probe = ("-c", "import rootstock, ase, numpy")
    if as_user(OUTSIDER, sys.executable, *probe, check=False).returncode == 0:
        return sys.executable
    venv = base / "client-venv"
    # Debian's own Python: a PATH lookup may find a pyenv shim under /root (0700).
    python = next(p for p in ("/usr/bin/python3.11", "/usr/bin/python3") if os.path.exists(p))
    subprocess.run([_uv(), "venv", "--quiet", "--python", python, venv], check=True, timeout=300)
    subprocess.run(
        [_uv(), "pip", "install", "--quiet", "--python", venv / "bin" / "python", "-e", REPO],
        check=True,
        timeout=600,
    )
    result = str(venv / "bin" / "python")
    as_user(OUTSIDER, result, *probe)
    return result


def rootstock_as(user: str, client: str, *args, **kwargs) -> subprocess.CompletedProcess:
    return as_user(user, client, "-m", "rootstock.cli.main", *args, **kwargs)


def setup_perms_as(user: str, client: str, root: Path, *extra, **kwargs):
    """``setup-perms ROOT --group PROJECT ... --apply --yes`` as ``user``."""
    args = ("setup-perms", root, "--group", PROJECT, *extra, "--apply", "--yes")
    return rootstock_as(user, client, *args, **kwargs)


def audit(*roots: Path, user: str = OUTSIDER) -> subprocess.CompletedProcess:
    return as_user(user, "bash", AUDIT, *roots, check=False, timeout=120)


# --- the shared install, built by the maintainer --------------------------------------


@pytest.fixture(scope="module")
def install(base: Path, client_python: str) -> Path:
    """setup-perms, init, install and add, all as the maintainer with umask 077."""
    root = base / "install"
    run = lambda *a, **k: rootstock_as(MAINT, client_python, *a, umask="077", **k)  # noqa: E731
    run("setup-perms", root, "--group", PROJECT, "--apply", "--yes")
    run("init", "--root", root, "--cluster", "testbox", "--yes")
    run("install", EMT_ENV, "--root", root, "--python", "/usr/bin/python3", timeout=900)
    run("add", "emt", "--device", "cpu", "--root", root)
    return root


def test_check_perms_is_clean_after_setup(install: Path, client_python: str):
    proc = rootstock_as(OUTSIDER, client_python, "check-perms", install, "--group", PROJECT)
    assert "no problems" in proc.stdout
    doc = json.loads(rootstock_as(OUTSIDER, client_python, "check-perms", install, "--json").stdout)
    assert doc["ok"] is True and doc["problems"] == []
    assert doc["usage_spool"] == {
        "path": str(install / "usage"),
        "target": None,
        "state": "present",
    }
    assert stat.S_IMODE(os.stat(install / "usage").st_mode) & 0o1777 == 0o1777


def test_audit_is_clean_on_the_real_install(install: Path):
    proc = audit(install)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok: no violations" in proc.stdout


def test_group_member_can_write(install: Path):
    as_user(MEMBER, "touch", install / "member-file")
    as_user(MEMBER, "mkdir", install / "environments" / "member-dir")
    as_user(MEMBER, "rm", install / "member-file")
    as_user(MEMBER, "rmdir", install / "environments" / "member-dir")


def test_outsider_can_read_and_traverse_but_not_write(install: Path):
    env_dir = install / "envs" / "emt"
    as_user(OUTSIDER, "cat", install / "layout.json", install / "manifest.json")
    as_user(OUTSIDER, "cat", env_dir / "env_source.py", env_dir / "rootstock-env.json")
    as_user(OUTSIDER, "ls", install / "envs", env_dir / "bin", install / ".uv-cache")
    for target in (install / "intruder", install / "envs" / "intruder"):
        proc = as_user(OUTSIDER, "touch", target, check=False)
        assert proc.returncode != 0 and "Permission denied" in proc.stderr
    proc = as_user(OUTSIDER, "sh", "-c", f"echo x >> {env_dir / 'env_source.py'}", check=False)
    assert proc.returncode != 0


def test_files_created_later_inherit_group_and_modes(install: Path):
    gid = pwd.getpwnam(MAINT).pw_gid
    # A restrictive umask: the default ACLs, not the umask, decide the modes.
    as_user(MAINT, "mkdir", install / "later", umask="077")
    as_user(MAINT, "sh", "-c", f"echo data > {install / 'later' / 'file'}", umask="077")
    as_user(MEMBER, "sh", "-c", f"echo more >> {install / 'later' / 'file'}", umask="077")
    new_dir, new_file = os.stat(install / "later"), os.stat(install / "later" / "file")
    project_gid = os.stat(install).st_gid
    assert project_gid != gid
    assert new_dir.st_gid == project_gid and new_file.st_gid == project_gid
    assert new_dir.st_mode & stat.S_ISGID
    assert new_dir.st_mode & 0o005 == 0o005 and new_file.st_mode & 0o004
    assert as_user(OUTSIDER, "cat", install / "later" / "file").stdout == "data\nmore\n"
    # What rootstock itself wrote while building is in the group too.
    env_source = install / "envs" / "emt" / "env_source.py"
    assert os.stat(env_source).st_gid == project_gid
    shutil.rmtree(install / "later")


CALCULATION = """
import json, sys
from ase.build import bulk
from ase.calculators.emt import EMT
from rootstock import RootstockCalculator

atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
atoms.rattle(0.05, seed=1)
reference = atoms.copy()
reference.calc = EMT()
with RootstockCalculator(checkpoint="emt", root=sys.argv[1], device="cpu", timeout=120) as calc:
    atoms.calc = calc
    energy = atoms.get_potential_energy()
    forces = atoms.get_forces()
    staged = calc.staged
print(json.dumps({
    "staged": staged,
    "energy": energy,
    "reference": reference.get_potential_energy(),
    "force_error": float(abs(forces - reference.get_forces()).max()),
}))
"""


def test_outsider_computes_through_rootstock_calculator(install: Path, base: Path, client_python):
    script = base / "calculation.py"
    script.write_text(CALCULATION)
    os.chmod(script, 0o644)
    proc = as_user(OUTSIDER, client_python, script, install, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["energy"] == pytest.approx(result["reference"], abs=1e-10)
    assert result["force_error"] < 1e-10
    # The maintainer's install packed an image (world-readable though built with umask
    # 077), so the outsider's worker ran from a stage of its own, without root: a mount
    # where this user may use /dev/fuse, else an extracted copy.
    assert result["staged"] == _expected_stage(OUTSIDER)
    outsider_stage = STAGES / f".rootstock-stage-{pwd.getpwnam(OUTSIDER).pw_uid}"
    assert outsider_stage.stat().st_uid == pwd.getpwnam(OUTSIDER).pw_uid
    assert stat.S_IMODE(outsider_stage.stat().st_mode) == 0o700
    # add's verification ran as the maintainer, staged too, and says so.
    manifest = json.loads((install / "manifest.json").read_text())
    (record,) = manifest["envs"]["emt"]["checkpoints"]["emt"]["verifications"].values()
    assert record["cpu"]["staged"] == _expected_stage(MAINT)


def _expected_stage(user: str) -> str:
    fuse = os.stat("/dev/fuse")
    entry = pwd.getpwnam(user)
    usable = fuse.st_mode & 0o006 == 0o006 or (
        fuse.st_gid in os.getgrouplist(user, entry.pw_gid) and fuse.st_mode & 0o060 == 0o060
    )
    return "mount" if usable and shutil.which("squashfuse") else "copy"


# Every command that only shows state, as the outsider runs it: none may need write
# access to the install (status used to take an env's lock to test it).
ROOT = "{root}"
READ_ONLY_COMMANDS = (
    ("status", "--root", ROOT),
    ("status", "--json", "--root", ROOT),
    ("status", "--sizes", "--json", "--root", ROOT),
    ("list", "--root", ROOT),
    ("list", "--json", "--root", ROOT),
    ("resolve", "--json", "--root", ROOT),
    ("manifest", "show", "--root", ROOT),
    ("manifest", "show", "--json", "--root", ROOT),
    ("usage", "report", "--json", "--root", ROOT),
    ("check-perms", ROOT, "--json"),
    ("benchmark", "emt", "--device", "cpu", "--system", "Cu:4", "--calls", "2", "--warmup", "0",
     "--root", ROOT),
)  # fmt: skip


def test_outsider_runs_every_read_only_command(install: Path, client_python: str):
    for command in READ_ONLY_COMMANDS:
        argv = [str(install) if arg == ROOT else arg for arg in command]
        proc = rootstock_as(OUTSIDER, client_python, *argv, check=False)
        said = f"{' '.join(argv)} ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        assert proc.returncode == 0, said
        assert "Permission denied" not in proc.stderr and "Traceback" not in proc.stderr, said
    args = ("status", "--json", "--root", install)
    doc = json.loads(rootstock_as(OUTSIDER, client_python, *args).stdout)
    (emt,) = [env for env in doc["envs"] if env["name"] == "emt"]
    assert emt["state"] == "built"
    assert emt["checkpoints"][0]["states"]["testbox"]["state"] == "verified"


def test_outsider_sees_a_build_in_progress(install: Path, client_python: str):
    from rootstock.install.build import env_build_lock, write_build_owner

    # Begun here as an install begins one: the build lock, then the owner record in
    # .build/. The outsider cannot open the lock file; the record tells it.
    layout = InstallLayout(install, install)
    with env_build_lock(layout, "emt"):
        owner = write_build_owner(layout, "emt")
        try:
            args = ("status", "--json", "--root", install)
            doc = json.loads(rootstock_as(OUTSIDER, client_python, *args).stdout)
        finally:
            owner.unlink()
    assert [env["state"] for env in doc["envs"] if env["name"] == "emt"] == ["building"]


READ_LOCK = """
import fcntl, json, os, sys
outcome = {}
for path in sys.argv[1:]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        outcome[path] = "held"
    except OSError as exc:
        outcome[path] = exc.strerror
print(json.dumps(outcome))
"""


def test_only_maintainers_can_open_the_lock_files(install: Path, client_python: str):
    """A read lock needs only read access and stalls every writer, so the outsider
    cannot open a lock file at all; the second group member takes the locks and
    writes the manifest."""
    locks = sorted(str(p) for p in (install / ".locks").glob("*.lock"))
    assert {Path(p).name for p in locks} >= {"manifest.lock", "root.lock", "env-emt.lock"}
    proc = as_user(OUTSIDER, client_python, "-c", READ_LOCK, *locks)
    assert set(json.loads(proc.stdout).values()) == {"Permission denied"}
    assert stat.S_IMODE(os.stat(install / ".locks").st_mode) & 0o007 == 0
    args = ("manifest", "init", "--root", install, "--cluster", "testbox", "--no-push")
    rootstock_as(MEMBER, client_python, *args, timeout=120)
    proc = as_user(MEMBER, client_python, "-c", READ_LOCK, *locks)
    assert set(json.loads(proc.stdout).values()) == {"held"}


# --- planted violations: each tool catches each kind ----------------------------------


@pytest.fixture
def tree(base: Path, client_python: str, request) -> Iterator[Path]:
    """A small, correct install (setup-perms + init as the maintainer), checked clean."""
    parent = base / f"planted-{secrets.token_hex(3)}"
    as_user(MAINT, "mkdir", parent)
    root = parent / "install"
    setup_perms_as(MAINT, client_python, root)
    rootstock_as(MAINT, client_python, "init", "--root", root, "--cluster", "testbox", "--yes")
    as_user(MAINT, "mkdir", "-p", root / "environments" / "deep")
    as_user(MAINT, "sh", "-c", f"echo x > {root / 'environments' / 'deep' / 'file.py'}")
    assert check_perms_as_root(client_python, root).returncode == 0
    assert audit(root).returncode == 0
    yield root
    shutil.rmtree(parent, ignore_errors=True)


def check_perms_as_root(client_python: str, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [client_python, "-m", "rootstock.cli.main", "check-perms", root, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _plant(kind: str, root: Path) -> tuple[Path, str, str]:
    """Plant one violation; return the path and the kinds check-perms and the audit name."""
    if kind == "ancestor":
        os.chmod(root.parent, 0o2770)
        return root.parent, "ancestor-traverse", "ancestor"
    if kind == "file-0640":
        path = root / "layout.json"
        os.chmod(path, 0o640)
        return path, "not-world-readable", "file-unreadable"
    if kind == "mask-clamp":
        path = root / "manifest.json"
        _sh("setfacl", "-m", "m::---", str(path))
        return path, "mask-clamp", "mask-clamp"
    if kind == "user-acl":
        _sh("setfacl", "-m", f"u:{OUTSIDER}:rwx", str(root))
        return root, "user-acl", "user-acl"
    if kind == "no-setgid":
        os.chmod(root, 0o775)
        return root, "no-setgid", "dir-nosetgid"
    if kind == "locks-open":
        os.chmod(root / ".locks", 0o2775)  # what versions before private locks made
        return root / ".locks", "locks-open", "locks-open"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["ancestor", "file-0640", "mask-clamp", "user-acl", "no-setgid", "locks-open"]
)
def test_both_checks_catch_a_planted_violation(tree: Path, client_python: str, kind: str):
    path, check_kind, audit_kind = _plant(kind, tree)

    proc = check_perms_as_root(client_python, tree)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = {(p["kind"], p["path"]) for p in json.loads(proc.stdout)["problems"]}
    assert (check_kind, str(path)) in found, found

    result = audit(tree, user="root")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"[{audit_kind}] {path}:" in result.stdout, result.stdout
    assert "fix: " in result.stdout


@pytest.mark.parametrize(
    ("plant", "kind"),
    [
        (lambda p: os.chmod(p, 0o640), "file-unreadable"),
        (lambda p: _sh("setfacl", "-m", "m::---", str(p)), "mask-clamp"),
        (lambda p: _sh("setfacl", "-m", f"u:{OUTSIDER}:r", str(p)), "user-acl"),
        (lambda p: os.chmod(p.parent, 0o775), "dir-nosetgid"),
        (lambda p: os.chmod(p, 0o666), "world-writable"),
        (lambda p: _sh("setfacl", "-d", "-m", "o::---", str(p.parent)), "default-acl"),
    ],
    ids=["0640", "mask-clamp", "user-acl", "no-setgid", "world-writable", "default-acl"],
)
def test_audit_walks_the_whole_tree(tree: Path, plant, kind: str):
    deep = tree / "environments" / "deep" / "file.py"
    plant(deep)
    result = audit(tree)
    assert result.returncode == 1, result.stdout
    where = deep.parent if kind in ("dir-nosetgid", "default-acl") else deep
    assert f"[{kind}] {where}:" in result.stdout, result.stdout


def test_audit_follows_symlinks_out_of_the_tree(tree: Path, base: Path):
    private = base / "private-python"
    as_user(MAINT, "mkdir", "-m", "700", private)
    as_user(MAINT, "sh", "-c", f"cp /bin/true {private}/python3 && chmod 755 {private}/python3")
    env = tree / "envs" / "private"
    as_user(MAINT, "mkdir", "-p", env / "bin")
    as_user(MAINT, "ln", "-s", private / "python3", env / "bin" / "python")
    as_user(MAINT, "ln", "-s", tree / "nowhere", env / "dangling")
    result = audit(tree, user="root")
    assert result.returncode == 1
    assert f"[ancestor] {private}: others cannot traverse it" in result.stdout
    assert f"[symlink] {env / 'dangling'}: dangling" in result.stdout
    shutil.rmtree(private)


def test_check_perms_catches_an_env_on_a_private_interpreter(
    tree: Path, base: Path, client_python: str
):
    private = base / "private-home"
    as_user(MAINT, "mkdir", "-m", "700", private)
    env = tree / "envs" / "private"
    as_user(MAINT, "mkdir", "-p", env)
    metadata = {"interpreter": {"path": str(private / "bin" / "python3")}}
    as_user(MAINT, "sh", "-c", f"echo '{json.dumps(metadata)}' > {env / 'rootstock-env.json'}")
    proc = check_perms_as_root(client_python, tree)
    problems = json.loads(proc.stdout)["problems"]
    assert proc.returncode == 1
    assert {"kind": "ancestor-traverse", "path": str(private)} in [
        {"kind": p["kind"], "path": p["path"]} for p in problems
    ]
    assert any("interpreter of env 'private'" in p["message"] for p in problems)
    shutil.rmtree(private)


# --- the spool variants ------------------------------------------------------------------


def test_usage_dir_links_a_spool_outside_the_install(base: Path, client_python: str):
    root, spool = base / "linked" / "install", base / "linked" / "spool"
    as_user(MAINT, "mkdir", base / "linked")
    setup_perms_as(MAINT, client_python, root, "--usage-dir", spool)
    assert os.readlink(root / "usage") == str(spool)
    assert stat.S_IMODE(os.stat(spool).st_mode) & 0o1777 == 0o1777
    as_user(OUTSIDER, "touch", root / "usage" / "record-from-outsider")
    doc = json.loads(check_perms_as_root(client_python, root).stdout)
    assert doc["ok"] and doc["usage_spool"]["state"] == "linked"
    assert doc["usage_spool"]["target"] == str(spool)
    shutil.rmtree(base / "linked")


def test_no_usage_spool_is_a_choice_check_perms_respects(base: Path, client_python: str):
    root = base / "nospool"
    setup_perms_as(MAINT, client_python, root, "--no-usage-spool")
    assert not (root / "usage").exists()
    doc = json.loads(check_perms_as_root(client_python, root).stdout)
    assert doc["ok"], doc
    assert doc["usage_spool"]["state"] == "disabled"
    shutil.rmtree(root)


def test_setup_perms_stops_at_the_first_failure_and_reports(base: Path, client_python):
    # The outsider owns its directory but cannot chgrp to a group it is not in.
    area = base / "outsider-area"
    area.mkdir()
    shutil.chown(area, user=OUTSIDER, group=OUTSIDER)
    os.chmod(area, 0o755)
    root = area / "install"
    proc = setup_perms_as(OUTSIDER, client_python, root, check=False)
    assert proc.returncode == 1
    assert "note: you are not in group" in proc.stderr
    assert f"stopped at a failed command (exit code 1): chgrp -- {PROJECT} {root}\n" in proc.stderr
    assert "Operation not permitted" in proc.stderr
    assert "+ setfacl" not in proc.stderr, "nothing after the failure may run"
    assert "later commands were not run" in proc.stderr
    assert "the filesystem did not honour" in proc.stderr and "no setgid bit" in proc.stderr
    shutil.rmtree(area)


def test_install_warns_up_front_and_never_blocks(base: Path, client_python: str):
    root = base / "unshared"
    as_user(MAINT, "mkdir", root, umask="022")
    os.chmod(root, 0o755)  # no setgid, no ACLs: what a root without setup-perms looks like
    # Outside $HOME and /tmp, so init --yes records it as shared, and says so.
    init = ("init", "--root", root, "--cluster", "testbox", "--yes")
    assert "recorded" in rootstock_as(MAINT, client_python, *init).stderr
    missing = base / "nosuchenv.py"  # a path, not a name: checked after the warning
    proc = rootstock_as(MAINT, client_python, "install", missing, "--root", root, check=False)
    # One line for no-setgid, no-group-acl and no-default-acl; check-perms has the rest.
    assert proc.stderr.splitlines()[0] == (
        "warning: 3 permission problems make this root unusable by others; "
        f"run rootstock check-perms {root} for details"
    ), proc.stderr
    assert proc.stderr.splitlines()[1] == f"error: env file {missing} does not exist"
    args = ("install", missing, "--root", root, "--no-perm-check")
    quiet = rootstock_as(MAINT, client_python, *args, check=False)
    assert "warning:" not in quiet.stderr
    assert quiet.returncode == proc.returncode
    # The same root recorded private draws no warning at all.
    rootstock_as(MAINT, client_python, *init, "--force", "--private")
    private = rootstock_as(MAINT, client_python, "install", missing, "--root", root, check=False)
    assert private.stderr.startswith(f"error: env file {missing} does not exist"), private.stderr
    shutil.rmtree(root)


# --- the ordering bug ------------------------------------------------------------------


def test_acl_writes_and_setgid_on_this_filesystem(base: Path):
    """Does an ACL write after chmod lose setgid here?

    Linux (ext4, xfs, tmpfs, btrfs: ``posix_acl_update_mode``) clears setgid on an
    ACL write only when the caller is neither in the file's group nor holds
    CAP_FSETID. So for a maintainer *in* the project group, chmod-then-setfacl keeps
    setgid on this filesystem: the CFS behaviour (losing it regardless) is not
    reproduced. A maintainer whose session lacks the group (added after logging in)
    does lose it, which is shown below. Either way the recipe asserts the mode last.
    """
    acl = f"u::rwx,g::rwx,g:{PROJECT}:rwx,m::rwx,o::r-x"

    def chmod_then_setfacl(path: Path, *setpriv_groups: str) -> bool:
        as_user(MAINT, "mkdir", path)
        as_user(MAINT, "chgrp", PROJECT, path)
        as_user(MAINT, "chmod", "2775", path)
        entry = pwd.getpwnam(MAINT)
        ids = (f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", *setpriv_groups)
        setfacl = ("setfacl", "-m", acl, str(path))
        subprocess.run(
            ["setpriv", *ids, "--", *setfacl], check=True, capture_output=True, timeout=30
        )
        return bool(os.stat(path).st_mode & stat.S_ISGID)

    member_keeps = chmod_then_setfacl(base / "order-member", "--init-groups")
    no_group_keeps = chmod_then_setfacl(base / "order-no-group", "--clear-groups")
    # Shown in the test summary, so a run on another filesystem records what it saw.
    warnings.warn(
        "chmod 2775 then setfacl on this filesystem: setgid "
        f"{'kept' if member_keeps else 'LOST'} for a group member (CFS loses it), "
        f"{'kept' if no_group_keeps else 'lost'} for an owner whose session lacks the group",
        stacklevel=1,
    )

    recipe = build_recipe(InstallLayout(base / "x", base / "x"), PROJECT)
    programs = [c.argv[0] for c in recipe.commands]
    assert max(i for i, p in enumerate(programs) if p == "setfacl") < programs.index("chmod")
    for name in ("order-member", "order-no-group"):
        shutil.rmtree(base / name)
