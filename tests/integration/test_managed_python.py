"""The managed-interpreter path, offline, and the fallback when downloads fail.

uv installs managed Pythons from python-build-standalone release archives listed in
a download list; ``UV_PYTHON_DOWNLOADS_JSON_URL`` replaces the built-in list with
one read from a local path (or a ``file://``/``http(s)://`` URL), and a ``file://``
archive URL is read from disk. The session fixture builds such a list from this
machine's own Python: an "install_only"-shaped ``.tar.gz`` (``python/bin/python3.X``
and ``python/lib/python3.X``) of the interpreter running the tests, with its sha256.
The machine's CPython must be relocatable for that (Debian's ``/usr/bin/python3.11``
links libpython statically and finds its stdlib next to itself).

No test here touches the network: the "unreachable" lists point the archive at a
loopback port nothing listens on, or at a file that does not exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rootstock.install import interpreters
from rootstock.install.interpreters import choose_interpreter, world_usable
from rootstock.install.layout import InstallLayout
from tests.conftest import make_root, run_rootstock
from tests.integration.images import worker_argv0

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="builds a Linux archive"),
]

JSON_URL = "UV_PYTHON_DOWNLOADS_JSON_URL"
# Settings a developer's shell may carry that would redirect or forbid the download.
INTERFERING = (
    "UV_PYTHON_INSTALL_MIRROR",
    "UV_PYTHON_CACHE_DIR",
    "UV_PYTHON_DOWNLOADS",
    "UV_PYTHON_PREFERENCE",
    "UV_PYTHON_INSTALL_BIN",
    "UV_PYTHON_BIN_DIR",
)
# Parts of the stdlib an env never needs; leaving them out keeps the archive ~7 MB.
SKIPPED_DIRS = {
    "__pycache__",
    "test",
    "tests",
    "idlelib",
    "tkinter",
    "turtledemo",
    "lib2to3",
    "ensurepip",
    "site-packages",
    "dist-packages",
}
# Debian's sitecustomize.py links into /etc; EXTERNALLY-MANAGED is about the system's pip.
SKIPPED_FILES = {"sitecustomize.py", "EXTERNALLY-MANAGED"}

TINY_ENV = textwrap.dedent('''\
    """A tiny env built on the uv-managed Python."""

    # /// script
    # requires-python = ">=3.11"
    # dependencies = ["ase"]
    # ///

    CHECKPOINTS = {"emt": "ase.calculators.emt.EMT"}


    def setup(checkpoint, device="cuda", **kw):
        from ase.calculators.emt import EMT

        return EMT()
    ''')


@dataclass(frozen=True)
class DownloadLists:
    """Download lists for uv, all naming the same CPython build."""

    version: str
    archive: Path
    good: Path  # the archive, by file:// URL
    unreachable: Path  # an http URL on a loopback port nothing listens on
    missing: Path  # a file:// URL of a file that does not exist


def python_says(python: Path | str, code: str) -> str:
    """What ``python -I -c code`` prints (stripped), with a deadline."""
    return subprocess.run(
        [str(python), "-I", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        stdin=subprocess.DEVNULL,
    ).stdout.strip()


def base_python() -> Path:
    """The real interpreter behind the test runner (its venv's base)."""
    return Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))


def _archive_filter(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    parts = info.name.split("/")
    if SKIPPED_DIRS.intersection(parts) or parts[-1] in SKIPPED_FILES:
        return None
    if parts[-1].startswith("config-"):  # the static libpython for embedding: 25 MB
        return None
    return info


def build_install_only_archive(dest: Path) -> tuple[Path, str]:
    """Pack the machine's Python like python-build-standalone's install_only archive."""
    v = sys.version_info
    tag = f"python{v.major}.{v.minor}"
    archive = dest / f"cpython-{v.major}.{v.minor}.{v.micro}-local-install_only.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(base_python(), f"python/bin/{tag}")
        tar.add(sysconfig.get_path("stdlib"), f"python/lib/{tag}", filter=_archive_filter)
        if sysconfig.get_config_var("Py_ENABLE_SHARED"):
            # A shared-libpython build: ship the library where standalone builds keep it.
            soname = sysconfig.get_config_var("INSTSONAME")
            tar.add(Path(sysconfig.get_config_var("LIBDIR")) / soname, f"python/lib/{soname}")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    return archive, digest


def download_entry(url: str, sha256: str | None) -> dict:
    """One entry of uv's download list (the shape of uv's download-metadata.json)."""
    v = sys.version_info
    libc = "gnu" if platform.libc_ver()[0] == "glibc" else "musl"
    arch = platform.machine()
    return {
        f"cpython-{v.major}.{v.minor}.{v.micro}-linux-{arch}-{libc}": {
            "name": "cpython",
            "arch": {"family": arch, "variant": None},
            "os": "linux",
            "libc": libc,
            "major": v.major,
            "minor": v.minor,
            "patch": v.micro,
            "prerelease": "",
            "url": url,
            "sha256": sha256,
            "variant": None,
            "build": "rootstock-test",
        }
    }


def unused_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def python_downloads(tmp_path_factory) -> DownloadLists:
    """The machine's Python as a uv download list (built once per session, in ~1 s)."""
    dest = tmp_path_factory.mktemp("python-downloads")
    archive, digest = build_install_only_archive(dest)
    lists = {
        "good": download_entry(archive.as_uri(), digest),
        "unreachable": download_entry(
            f"http://127.0.0.1:{unused_loopback_port()}/{archive.name}", digest
        ),
        "missing": download_entry((dest / "gone" / archive.name).as_uri(), digest),
    }
    paths = {}
    for name, content in lists.items():
        paths[name] = dest / f"{name}.json"
        paths[name].write_text(json.dumps(content, indent=1))
    version = "{}.{}.{}".format(*sys.version_info[:3])
    return DownloadLists(version, archive, **paths)


@pytest.fixture
def uv_env(monkeypatch) -> pytest.MonkeyPatch:
    for key in INTERFERING:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.fixture
def uv_calls(monkeypatch) -> list[list[str]]:
    """Every argument list interpreters.py hands to uv, recorded as it runs."""
    calls: list[list[str]] = []
    real = interpreters.run_uv

    def recording(layout, args, **kwargs):
        calls.append([str(a) for a in args])
        return real(layout, args, **kwargs)

    monkeypatch.setattr(interpreters, "run_uv", recording)
    return calls


#: Where world_dir goes: not $TMPDIR or tmp_path, which may lie below a 0700 directory
#: (the test run's own temp dir is one), but /tmp itself, which every user can traverse.
WORLD_BASE = Path("/tmp")


@pytest.fixture
def world_dir() -> Iterator[Path]:
    """A 0755 directory every user can traverse, whatever $TMPDIR and tmp_path are."""
    for directory in (WORLD_BASE, *WORLD_BASE.parents):
        assert directory.stat().st_mode & stat.S_IXOTH, f"{directory} is not o+x"
    path = Path(tempfile.mkdtemp(prefix="rs-world-", dir=WORLD_BASE))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def tmp_layout(tmp_path: Path) -> InstallLayout:
    root = tmp_path / "root"
    root.mkdir()
    return InstallLayout(root, root)


def installs(calls: list[list[str]]) -> list[list[str]]:
    return [c for c in calls if c[:2] == ["python", "install"]]


def marker_of(layout: InstallLayout) -> Path:
    return layout.python_dir / ".downloads-unavailable.json"


def test_managed_python_from_local_download_list(tmp_path, python_downloads, uv_env, uv_calls):
    layout = tmp_layout(tmp_path)
    uv_env.setenv(JSON_URL, str(python_downloads.good))

    choice = choose_interpreter(layout, ">=3.11", "test")

    interp = choice.interpreter
    assert interp.source == "managed", choice.notes
    assert interp.path.is_relative_to(layout.python_dir)
    assert interp.version == python_downloads.version
    assert len(installs(uv_calls)) == 1
    assert not any("local interpreter" in note for note in choice.notes)
    assert not marker_of(layout).exists()
    # --no-bin: nothing linked into a bin directory of the (redirected) HOME.
    assert not (layout.home_dir / ".local" / "bin").exists()
    out = python_says(interp.path, "import sys, ssl, json; print(sys.prefix)")
    assert Path(out).resolve().is_relative_to(layout.python_dir.resolve())

    # The second choice finds it: no download, even with a list that cannot download.
    uv_env.setenv(JSON_URL, str(python_downloads.unreachable))
    uv_calls.clear()
    again = choose_interpreter(layout, ">=3.11", "test")
    assert again.interpreter.source == "managed", again.notes
    assert again.interpreter.path == interp.path
    assert installs(uv_calls) == []
    assert not marker_of(layout).exists()


@pytest.mark.parametrize("which", ["unreachable", "missing"])
def test_failed_download_falls_back_to_local_and_remembers(
    tmp_path, python_downloads, uv_env, uv_calls, which
):
    layout = tmp_layout(tmp_path)
    uv_env.setenv(JSON_URL, str(getattr(python_downloads, which)))

    choice = choose_interpreter(layout, ">=3.11", "test")

    assert choice.interpreter.source == "local"
    assert tuple(map(int, choice.interpreter.version.split(".")[:2])) >= (3, 11)
    assert len(installs(uv_calls)) == 1
    assert all("\n" not in note for note in choice.notes), choice.notes
    failed = [n for n in choice.notes if n.startswith("uv could not download a managed Python")]
    assert len(failed) == 1, choice.notes
    assert any(n.startswith("using local interpreter") for n in choice.notes)
    marker = marker_of(layout)
    recorded = json.loads(marker.read_text())
    assert recorded["reason"] and isinstance(recorded["at"], float)

    # The marker spares the next build the attempt, and the note says how to retry.
    uv_calls.clear()
    again = choose_interpreter(layout, ">=3.11", "test")
    assert again.interpreter.source == "local"
    assert installs(uv_calls) == []
    assert any(str(marker) in note for note in again.notes), again.notes
    assert all("\n" not in note for note in again.notes)

    # Deleting the marker retries: with a working list the managed Python comes back.
    marker.unlink()
    uv_env.setenv(JSON_URL, str(python_downloads.good))
    retried = choose_interpreter(layout, ">=3.11", "test")
    assert retried.interpreter.source == "managed", retried.notes


def test_install_builds_env_on_managed_python(tmp_path, python_downloads, shared_uv_cache, uv_env):
    root = make_root(tmp_path / "root", shared_uv_cache)
    env_file = tmp_path / "envfiles" / "tinymanaged.py"
    env_file.parent.mkdir()
    env_file.write_text(TINY_ENV)

    proc = run_rootstock(
        "install",
        env_file,
        "--root",
        root,
        env={JSON_URL: str(python_downloads.good)},
        timeout=600,
    )

    assert "using local interpreter" not in proc.stdout + proc.stderr
    env_dir = root / "envs" / "tinymanaged"
    meta = json.loads((env_dir / "rootstock-env.json").read_text())
    assert meta["interpreter"]["source"] == "managed", meta["interpreter"]
    assert meta["interpreter"]["version"] == python_downloads.version
    assert Path(meta["interpreter"]["path"]).is_relative_to(root / ".python")
    base = python_says(env_dir / "bin" / "python", "import sys, ase; print(sys.base_prefix)")
    assert Path(base).resolve().is_relative_to((root / ".python").resolve())


def test_world_usable_reads_mode_bits_along_the_real_path(world_dir):
    # Root passes every permission check, so these assert the mode logic, not access.
    public = world_dir / "public"
    private = world_dir / "private"
    public.mkdir()
    private.mkdir()
    public.chmod(0o755)  # mkdir's mode is masked by the umask; chmod is not
    private.chmod(0o700)
    for directory in (public, private):
        exe = directory / "python3"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    no_other_x = public / "python3-group-only"
    no_other_x.write_text("#!/bin/sh\n")
    no_other_x.chmod(0o750)
    link_to_private = public / "python-link"
    link_to_private.symlink_to(private / "python3")

    assert world_usable(public / "python3")
    assert not world_usable(private / "python3")
    assert not world_usable(no_other_x)
    assert not world_usable(link_to_private)  # the target's directory decides
    assert not world_usable(public / "absent")
    assert stat.S_IMODE(private.stat().st_mode) == 0o700


def test_private_explicit_interpreter_is_warned_about(tmp_path, world_dir):
    layout = InstallLayout(tmp_path, tmp_path)
    private = world_dir / "home" / "alice"
    private.mkdir(parents=True)
    private.parent.chmod(0o755)
    private.chmod(0o700)
    copy = private / "python3"
    shutil.copy2(base_python(), copy)
    copy.chmod(0o755)

    choice = choose_interpreter(layout, ">=3.11", "test", explicit=str(copy))

    assert choice.interpreter.source == "explicit"
    assert choice.interpreter.path == copy
    assert not choice.interpreter.world_usable
    warnings = [n for n in choice.notes if n.startswith("warning:")]
    assert len(warnings) == 1 and str(copy) in warnings[0], choice.notes
    assert "not executable by other users" in warnings[0]

    # A private root's envs need work only for their owner: no warning there.
    private_root = choose_interpreter(layout, ">=3.11", "test", explicit=str(copy), shared=False)
    assert private_root.interpreter.path == copy
    assert not any(n.startswith("warning:") for n in private_root.notes), private_root.notes

    # The same interpreter in a directory everyone can traverse draws no warning.
    private.chmod(0o755)
    shared = choose_interpreter(layout, ">=3.11", "test", explicit=str(copy))
    assert shared.interpreter.world_usable
    assert not any(n.startswith("warning:") for n in shared.notes)


@pytest.mark.parametrize("mode", ["copy", "mount"])
def test_an_image_carries_the_managed_interpreter_into_the_stage(
    tmp_path, python_downloads, shared_uv_cache, uv_env, stage_dir, mode
):
    """The image holds the root's interpreter too: a staged worker needs nothing of
    ``.python/`` on the shared root (it is moved away while the worker runs)."""
    from ase.build import bulk
    from ase.calculators.emt import EMT

    from rootstock import RootstockCalculator

    root = make_root(tmp_path / "root", shared_uv_cache)
    env_file = tmp_path / "envfiles" / "tinymanaged.py"
    env_file.parent.mkdir()
    env_file.write_text(TINY_ENV)
    run_rootstock(
        "install", env_file, "--root", root, "--image", env={JSON_URL: str(python_downloads.good)}
    )
    atoms = bulk("Cu", cubic=True) * (2, 1, 1)
    atoms.rattle(0.05, seed=31)
    expected = atoms.copy()
    expected.calc = EMT()
    (root / ".python").rename(root / ".python-away")
    try:
        with RootstockCalculator("emt", root=root, device="cpu", stage=mode) as calc:
            atoms.calc = calc
            energy = atoms.get_potential_energy()
            assert calc.staged == mode
            stage_python = Path(worker_argv0(calc.worker_pid))
            # While the worker holds the stage (a mount stays), and .python/ is away.
            base = python_says(
                stage_python, "import sys, os; print(sys.base_prefix, os.__file__)"
            ).split()
    finally:
        (root / ".python-away").rename(root / ".python")
    assert energy == pytest.approx(expected.get_potential_energy(), abs=1e-12)
    prefix = stage_python.parent.parent
    assert prefix.is_relative_to(stage_dir)
    assert all(Path(p).is_relative_to(prefix) for p in base), base
