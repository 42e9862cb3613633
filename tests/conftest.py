"""Session-wide test setup: an isolated user config, shared uv caches, built roots.

Real uv builds are the expensive part of the suite, so each shared root is built
once per run, by whichever pytest process needs it first, and every other process
of the run (pytest-xdist workers) uses the same one (:mod:`tests.run_cache`); every
test root shares the run's uv cache.
Builds never resolve an unpinned torch: when the machine's CPU torch wheel is on
disk, every build gets its find-links directory and a constraint pinning that
exact local version (find-links alone loses to PyPI's newer CUDA build).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rootstock.install.layout import IMAGES_ENV
from tests.leftovers import find_leftovers, remove_leftovers
from tests.run_cache import make_run_dir, run_dir, run_lock, shared_build

REPO = Path(__file__).resolve().parent.parent
ENVIRONMENTS = REPO / "environments"
TEST_ENVS = Path(__file__).resolve().parent / "envs"
LOCAL_WHEELS = Path(os.environ.get("ROOTSTOCK_TEST_WHEELS", "/opt/wheels"))
ROOTSTOCK = [sys.executable, "-m", "rootstock.cli.main"]


def local_torch_wheel() -> Path | None:
    """The machine's CPU torch wheel for this Python, if one lies on disk."""
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    wheels = sorted(LOCAL_WHEELS.glob(f"torch-*-{tag}-*.whl"))
    return wheels[-1] if wheels else None


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """The first pytest process of a run makes the run's shared build directory, and a
    temp dir in it that every process of the run uses (its leftovers are looked for).
    pytest's own temp dir is fixed first, where it would be anyway (short paths keep
    socket paths in tests' tmp_path within their limit)."""
    made = make_run_dir()
    config.stash[_RUN_DIR_MADE] = made
    if made is not None:
        factory = getattr(config, "_tmp_path_factory", None)
        if factory is not None:
            factory.getbasetemp()
        (made / "tmp").mkdir()
        os.environ["TMPDIR"] = str(made / "tmp")
        tempfile.tempdir = None  # this process too
    # Builds pack no image unless a test asks (install --image): an image costs each
    # build seconds and a hundred MB or more of disk.
    os.environ.setdefault(IMAGES_ENV, "0")
    if made is not None:
        _let_workers_finish_their_exit()


#: How long pytest-xdist waits for a worker to exit before it kills it (its own is 10 s).
WORKER_EXIT_S = 180


def _let_workers_finish_their_exit() -> None:
    """Give each pytest-xdist worker time to run its exit finalizers.

    A worker's calculators that a test left open (a cache such as quacc's) are closed
    at its exit, by the finalizers that stop their workers and remove their run dirs.
    Whatever was registered at exit after them (a Parsl or Dask shutdown) runs first,
    and on a loaded machine the whole exit may take more than xdist's 10 s; a worker
    killed then leaves its run dirs, which the leftovers check reports (a fresh-clone
    run once failed so, on two workers' run dirs). Waiting longer keeps the product's
    own exit path under test; a worker still alive after that is killed, and what it
    left is reported as before.
    """
    try:
        from xdist.workermanage import NodeManager
    except ImportError:  # pytest-xdist not installed: one process, nothing to wait for
        return
    NodeManager.EXIT_TIMEOUT = max(NodeManager.EXIT_TIMEOUT, WORKER_EXIT_S)


#: The longest test files (the timing report that scripts/test writes), longest first.
#: Under scripts/test's workers they start first, so that none runs on alone at the end.
LONGEST_FIRST = (
    "test_checkpoints.py",
    "test_slurm_nightly.py",
    "test_sigkill_sync_prune.py",
    "test_batch_hooks.py",
    "test_family_uma.py",
    "test_with_mlipx.py",
    "test_batch_memory.py",
    "test_sigkill.py",
    "test_benchmark.py",
    "test_install.py",
    "test_prune.py",
    "test_usage.py",
    "test_mlip_checkpoints.py",
    "test_cli.py",
    "test_pool_concurrency.py",
    "test_generation_locks.py",
    "test_sync.py",
    "test_scale_out_parsl_slurm.py",
    "test_family_orb.py",
    "test_mlip_calculator.py",
    "test_hostile_input.py",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (a stable sort: each file's own order holds). Under
    scripts/test's ``--dist loadfile --no-loadscope-reorder`` the workers take files in
    this order, so the longest start first and none runs on alone at the end."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """The first pytest process fails the run if any process, mount or run dir of the
    run is left once every test and worker is done; then it removes them."""
    made = session.config.stash.get(_RUN_DIR_MADE, None)
    if made is None:
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    temp_roots = [factory.getbasetemp()] if factory is not None else []
    found = find_leftovers(made, made / "tmp", temp_roots)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if found.swept and reporter is not None:
        reporter.write_line(
            "swept the run dirs of processes that had died (as the next worker start "
            f"would): {', '.join(p.name for p in found.swept)}"
        )
    if not found:
        return
    lines = ["the test run left these behind (now removed):", *found.lines()]
    if reporter is not None:
        reporter.write_sep("=", "leftovers", red=True)
        for line in lines:
            reporter.write_line(line)
    else:
        print("\n".join(lines), file=sys.stderr)
    remove_leftovers(found)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_RUN_DIR_MADE, None)
    if made is not None:
        # uv leaves read-only files in its cache: make them removable first.
        subprocess.run(["chmod", "-R", "u+w", str(made)], check=False, timeout=300)
        shutil.rmtree(made, ignore_errors=True)


_RUN_DIR_MADE = pytest.StashKey[Path | None]()


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("session")


@pytest.fixture(scope="session", autouse=True)
def isolated_user(session_dir: Path):
    """No test reads or writes the real user's config or registry."""
    saved = {
        k: os.environ.get(k)
        for k in ("ROOTSTOCK_CONFIG", "ROOTSTOCK_ROOT", "ROOTSTOCK_CLUSTERS_FILE", "UV_CONSTRAINT")
    }
    os.environ["ROOTSTOCK_CONFIG"] = str(session_dir / "config.toml")
    for key in ("ROOTSTOCK_ROOT", "ROOTSTOCK_CLUSTERS_FILE"):
        os.environ.pop(key, None)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A fresh dir directly in /tmp, removed afterwards, for a test whose sockets must fit
    in ``sun_path``: pytest's tmp_path can be too long (under pytest-xdist it is), and
    then rootstock rightly puts its sockets elsewhere."""
    path = Path(tempfile.mkdtemp(prefix="rs-t-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def private_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A config.toml of the test's own (subprocesses inherit it), no root or registry.

    Files whose every test needs it name it in ``pytestmark``'s ``usefixtures``.
    """
    config = tmp_path / "user" / "config.toml"
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(config))
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    return config


@pytest.fixture(scope="session")
def torch_pin(session_dir: Path) -> dict[str, str]:
    """Environment variables that make uv take the local CPU torch wheel.

    Empty when no wheel is on disk: then PyPI's torch is the fallback.
    """
    wheel = local_torch_wheel()
    if wheel is None:
        return {}
    version = wheel.name.split("-")[1]
    constraint = session_dir / "torch-constraint.txt"
    constraint.write_text(f"torch=={version}\n")
    return {"UV_FIND_LINKS": str(wheel.parent), "UV_CONSTRAINT": str(constraint)}


@pytest.fixture(scope="session")
def shared_uv_cache() -> Path:
    """The run's uv cache, shared by every test root (uv locks it for concurrent use)."""
    cache = run_dir() / "uv-cache"
    cache.mkdir(exist_ok=True)
    return cache


def make_root(path: Path, uv_cache: Path, cluster: str = "testbox") -> Path:
    """An initialised install root whose uv cache is the session's shared one.

    init records its root and cluster in the user's config; here that goes to a
    throwaway file, so no test's cluster leaks into another's resolution.
    """
    env = {**os.environ, "ROOTSTOCK_CONFIG": str(path.parent / f".{path.name}-config.toml")}
    subprocess.run(
        [*ROOTSTOCK, "init", "--root", str(path), "--cluster", cluster, "--yes"],
        check=True,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
    )
    link = path / ".uv-cache"
    if not link.exists():
        link.symlink_to(uv_cache)
    return path


def installed_root(
    path: Path, uv_cache: Path, env_files: list[Path], cluster: str = "testbox"
) -> Path:
    """``make_root(path, ...)`` then ``rootstock install`` of each env file in turn, made
    as a copy of a root built exactly that way once per run (shared by every pytest
    process; keyed by the cluster, the uv cache and the files' names and contents).

    For a test whose subject is not the build: it gets a private, fully built root
    without paying a uv build. A built root is relocatable (relocatable venvs, a
    relative ``envs/<name>`` link, no absolute path in the manifest), so the copy is
    what a build at ``path`` would have made.
    """
    digest = hashlib.sha256(f"{cluster}\0{uv_cache}\0".encode())
    for env_file in env_files:
        digest.update(env_file.name.encode() + b"\0" + env_file.read_bytes() + b"\0")

    def build(template: Path) -> None:
        make_root(template, uv_cache, cluster=cluster)
        for env_file in env_files:
            run_rootstock("install", env_file, "--root", template, timeout=900)

    template = shared_build(f"root-{digest.hexdigest()[:16]}", build)
    return copy_root(template, path)


def copy_root(template: Path, path: Path) -> Path:
    """A full private copy of a built root (``cp -a``: modes, links and times kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", str(template), str(path)], check=True, timeout=600)
    return path


def run_rootstock(
    *args: str, env: dict | None = None, timeout: float = 900, check: bool = True
) -> subprocess.CompletedProcess:
    """Run the CLI as a user would, in a subprocess with a deadline."""
    proc = subprocess.run(
        [*ROOTSTOCK, *map(str, args)],
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"rootstock {' '.join(map(str, args))} failed ({proc.returncode}):\n"
            f"{proc.stdout}\n{proc.stderr}"
        )
    return proc


@pytest.fixture(scope="session")
def emt_root(shared_uv_cache: Path, torch_pin) -> Path:
    """A root with the sample EMT env built by real uv; shared by the run, never modified."""

    def build(root: Path) -> None:
        make_root(root, shared_uv_cache)
        run_rootstock("install", ENVIRONMENTS / "emt.py", "--root", root)

    return shared_build("emt-root", build)


@pytest.fixture
def scratch_root(tmp_path: Path, shared_uv_cache: Path) -> Path:
    """A fresh initialised root for a test that modifies it."""
    return make_root(tmp_path / "root", shared_uv_cache)


def copy_env(src: Path, dst_dir: Path, name: str | None = None) -> Path:
    """Copy an env file (optionally renaming the env) into ``dst_dir``."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / (f"{name}.py" if name else src.name)
    shutil.copyfile(src, dst)
    return dst


def user_uv_cache_dir() -> Path:
    """uv's default cache for this user (``$UV_CACHE_DIR``, else the XDG cache).

    The model-family envs pull gigabytes of wheels; keeping them in the user's own
    cache, not pytest's tmp, lets a repeat CI run on the same machine find it warm.
    """
    if os.environ.get("UV_CACHE_DIR"):
        return Path(os.environ["UV_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "uv"


@pytest.fixture(scope="session")
def user_uv_cache() -> Path:
    cache = user_uv_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    return cache


FAMILIES = ("chgnet", "sevennet", "mace", "orb", "tensornet", "uma")
FAMILY_BUILD_TIMEOUT = 2400.0


def _install_command(root: Path, name: str) -> list[str]:
    return [
        *ROOTSTOCK,
        "install",
        str(ENVIRONMENTS / f"{name}.py"),
        "--root",
        str(root),
        "--no-push",
    ]


def _is_built(root: Path, name: str) -> bool:
    return (root / "envs" / name / "rootstock-env.json").is_file()


def install_family(root: Path, name: str, torch_pin: dict[str, str]) -> Path:
    """Build ``environments/<name>.py`` into ``root`` unless it is already built there
    (one build per run: other test processes wait for it)."""
    with run_lock(f"family-{name}"):
        if not _is_built(root, name):
            run_rootstock(
                *_install_command(root, name)[len(ROOTSTOCK) :],
                env=torch_pin,
                timeout=FAMILY_BUILD_TIMEOUT,
            )
    return root / "envs" / name


def install_families(root: Path, names: list[str], torch_pin: dict[str, str]) -> None:
    """Build several family envs at once: each build waits mostly on downloads and
    disk, so running them side by side costs little more than the slowest one."""
    env = {**os.environ, **torch_pin}
    procs = {}
    for name in names:
        if _is_built(root, name):
            continue
        log = open(root.parent / f"build-{name}.log", "w+")  # noqa: SIM115 (closed below)
        procs[name] = (
            subprocess.Popen(
                _install_command(root, name),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            ),
            log,
        )
    failures = []
    try:
        for name, (proc, log) in procs.items():
            try:
                code = proc.wait(timeout=FAMILY_BUILD_TIMEOUT)
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                log.seek(0)
                failures.append(f"{name} (exit {code}):\n{log.read()[-4000:]}")
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            log.close()
    if failures:
        raise AssertionError("family env builds failed:\n" + "\n".join(failures))


#: The other mlip test files and the family envs they build with ``family_env``.
BATCH_TEST_FAMILIES = {
    "test_batch_hooks": ("chgnet", "sevennet", "mace", "orb"),
    "test_neb_shared": ("chgnet",),
    "test_scale_out_chgnet": ("chgnet",),
    "test_integrations_chgnet": ("chgnet",),
}


def families_needed(items) -> list[str]:
    """The family envs that the collected tests use: ``mlip_root`` needs CHGNet and
    SevenNet; a ``family_env`` test in ``test_family_<name>.py`` needs ``<name>``, and
    the files in ``BATCH_TEST_FAMILIES`` the families listed there."""
    names: set[str] = set()
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "mlip_root" in fixtures:
            names.update(("chgnet", "sevennet"))
        stem = Path(str(getattr(item, "path", ""))).stem
        if "family_env" in fixtures and stem.startswith("test_family_"):
            names.add(stem.removeprefix("test_family_"))
        names.update(BATCH_TEST_FAMILIES.get(stem, ()))
    return [name for name in FAMILIES if name in names]


@pytest.fixture(scope="session")
def family_root(request, user_uv_cache: Path, torch_pin) -> Path:
    """The run's root for real model-family envs.

    Every family env the collected tests use is built into it at once, side by side,
    by the first test process that needs it; ``family_env`` builds any other on
    first use.
    """

    def build(root: Path) -> None:
        make_root(root, user_uv_cache)
        install_families(root, families_needed(request.session.items), torch_pin)

    return shared_build("mlip-root", build)


@pytest.fixture(scope="session")
def mlip_root(family_root: Path, torch_pin) -> Path:
    """The family root with the CHGNet and SevenNet sample envs built.

    torch comes from the machine's CPU wheel (find-links plus an exact pin); where
    that file is absent the build falls back to PyPI's torch.
    """
    for name in ("chgnet", "sevennet"):
        install_family(family_root, name, torch_pin)
    return family_root
