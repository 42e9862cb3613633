"""Odd command lines: an ``error:`` line and exit code 1 or 2, never a traceback,
and never a changed file (issue #13).

Every command runs in-process through :func:`rootstock.cli.main.main` against a
real initialised install root (``layout.json``, ``manifest.json``, config.toml)
whose one env is a FAKE: ``envs/emt/env_source.py`` copied from the sample, with
no interpreter, so nothing can ever be spawned. Each case snapshots every file and
directory under the test's temp dir and checks it is byte-identical afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from rootstock.cli.main import main
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import ensure_manifest
from rootstock.install.parsing import MAX_KWARG_DEPTH
from rootstock.ops.init import InitRequest, init_root
from rootstock.ops.serve import SUN_PATH_MAX_BYTES, check_socket_path

pytestmark = pytest.mark.timeout(120)

SAMPLE_EMT = Path(__file__).resolve().parents[2] / "environments" / "emt.py"
ERROR_LINE = re.compile(r"^(error|Error): \S", re.MULTILINE)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@dataclass(frozen=True)
class Site:
    """A temp dir holding an install root, the user's config and a plain file."""

    tmp: Path
    root: Path
    afile: Path

    def fill(self, argv: tuple[str, ...]) -> list[str]:
        """``argv`` with ``{root}``, ``{tmp}`` and ``{afile}`` filled in."""
        return [
            a.replace("{root}", str(self.root))
            .replace("{tmp}", str(self.tmp))
            .replace("{afile}", str(self.afile))
            for a in argv
        ]


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Site:
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    registry = tmp_path / "clusters.toml"
    registry.write_text("")
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(registry))
    root = tmp_path / "root"
    init_root(InitRequest(root=root, cluster="box"))
    ensure_manifest(InstallLayout(root, root), ["box"])
    env_dir = root / "envs" / "emt"
    env_dir.mkdir(parents=True)
    shutil.copyfile(SAMPLE_EMT, env_dir / "env_source.py")
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    monkeypatch.chdir(tmp_path)  # new-env writes here when it wrongly succeeds
    return Site(tmp_path, root, afile)


def snapshot(top: Path) -> dict[str, bytes | None]:
    """Every path under ``top``: a file's bytes, or None for a directory.

    Lock files are left out: ``.locks/*.lock`` are empty flock targets, made on
    first use by whichever command takes the lock, and hold no data.
    """
    return {
        str(p.relative_to(top)): (None if p.is_dir() else p.read_bytes())
        for p in sorted(top.rglob("*"))
        if not (p.parent.name == ".locks" and p.suffix == ".lock")
    }


def run(capsys: pytest.CaptureFixture, argv: list[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


SOCKET = ("--socket", "s.sock")
# (id, argv, exit code)
CASES: list[tuple[str, tuple[str, ...], int]] = [
    # cluster names
    (
        "manifest-init-bad-name",
        ("manifest", "init", "--root", "{root}", "--cluster", "Bad Name!"),
        2,
    ),
    ("manifest-init-empty-name", ("manifest", "init", "--root", "{root}", "--cluster", ""), 2),
    (
        "manifest-init-second-name-bad",
        ("manifest", "init", "--root", "{root}", "--cluster", "box", "--cluster", "a/b"),
        2,
    ),
    ("status-name-with-space", ("status", "--root", "{root}", "--cluster", "bad name"), 2),
    ("status-empty-name", ("status", "--cluster", ""), 2),
    ("list-name-too-long", ("list", "--root", "{root}", "--cluster", "x" * 65), 2),
    ("resolve-unicode-name", ("resolve", "--cluster", "ÄÖ"), 2),
    ("resolve-leading-dash", ("resolve", "--cluster", "-box"), 2),
    ("add-path-as-name", ("add", "emt", "--root", "{root}", "--cluster", "../box"), 2),
    ("smoke-test-bang", ("smoke-test", "--root", "{root}", "--cluster", "box!"), 2),
    (
        "install-dry-run-name",
        ("install", "emt", "--root", "{root}", "--cluster", "a b", "--dry-run"),
        2,
    ),
    ("init-bad-name", ("init", "--root", "{tmp}/new", "--yes", "--cluster", "Bad Name!"), 2),
    ("check-perms-name", ("check-perms", "{root}", "--cluster", "x y"), 2),
    ("setup-perms-name", ("setup-perms", "{root}", "--group", "g", "--cluster", "x/y"), 2),
    ("manifest-push-name", ("manifest", "push", "--root", "{root}", "--cluster", "Bad!"), 2),
    ("benchmark-name", ("benchmark", "emt", "--root", "{root}", "--cluster", "bad name"), 2),
    ("serve-name", ("serve", "emt", *SOCKET, "--root", "{root}", "--cluster", "bad name"), 2),
    ("known-name-unknown-cluster", ("status", "--root", "{root}", "--cluster", "other"), 2),
    # devices
    ("add-device-path", ("add", "emt", "--root", "{root}", "--device", "../../etc"), 2),
    ("add-device-space", ("add", "emt", "--root", "{root}", "--device", "cuda 0"), 2),
    ("add-device-empty", ("add", "emt", "--root", "{root}", "--device", ""), 2),
    ("smoke-test-device-file", ("smoke-test", "--root", "{root}", "--device", "/dev/nvidia0"), 2),
    ("smoke-test-device-upper", ("smoke-test", "--root", "{root}", "--device", "CUDA"), 2),
    ("serve-device-index", ("serve", "emt", *SOCKET, "--root", "{root}", "--device", "cuda:x"), 2),
    (
        "benchmark-device-long-index",
        ("benchmark", "emt", "--root", "{root}", "--device", "cuda:1234"),
        2,
    ),
    ("benchmark-device-unknown", ("benchmark", "emt", "--root", "{root}", "--device", "tpu"), 2),
    # numbers
    ("add-timeout-nan", ("add", "emt", "--root", "{root}", "--verify-timeout", "nan"), 2),
    ("add-timeout-overflow", ("add", "emt", "--root", "{root}", "--verify-timeout", "1e400"), 2),
    ("smoke-test-negative-jobs", ("smoke-test", "--root", "{root}", "--jobs", "-1"), 2),
    ("smoke-test-huge-jobs", ("smoke-test", "--root", "{root}", "--jobs", str(10**12)), 2),
    ("smoke-test-push-every-0", ("smoke-test", "--root", "{root}", "--push-every", "0"), 2),
    ("benchmark-calls-text", ("benchmark", "emt", "--root", "{root}", "--calls", "abc"), 2),
    ("benchmark-warmup-negative", ("benchmark", "emt", "--root", "{root}", "--warmup", "-1"), 2),
    ("benchmark-timeout-inf", ("benchmark", "emt", "--root", "{root}", "--timeout", "inf"), 2),
    (
        "serve-connect-negative",
        ("serve", "emt", *SOCKET, "--root", "{root}", "--connect-timeout", "-1"),
        2,
    ),
    (
        "benchmark-system-zero-atoms",
        ("benchmark", "emt", "--root", "{root}", "--system", "Cu:0"),
        2,
    ),
    (
        "benchmark-system-huge",
        ("benchmark", "emt", "--root", "{root}", "--system", f"Cu:{10**12}"),
        2,
    ),
    ("benchmark-system-empty", ("benchmark", "emt", "--root", "{root}", "--system", ""), 2),
    # JSON on the command line
    (
        "add-kwarg-100000-open",
        ("add", "emt", "--root", "{root}", "--kwarg", "x=" + "[" * 100_000),
        2,
    ),
    ("add-kwarg-100-deep", ("add", "emt", "--root", "{root}", "--kwarg", "x=" + nested(100)), 2),
    ("add-kwarg-no-key", ("add", "emt", "--root", "{root}", "--kwarg", "=1"), 2),
    ("add-kwarg-twice", ("add", "emt", "--root", "{root}", "--kwarg", "a=1", "--kwarg", "a=2"), 2),
    (
        "serve-kwarg-deep",
        ("serve", "emt", *SOCKET, "--root", "{root}", "--kwarg", "x=" + nested(100)),
        2,
    ),
    (
        "benchmark-setup-kwargs-deep",
        ("benchmark", "emt", "--root", "{root}", "--setup-kwargs", "[" * 100_000),
        2,
    ),
    (
        "benchmark-setup-kwargs-list",
        ("benchmark", "emt", "--root", "{root}", "--setup-kwargs", "[1]"),
        2,
    ),
    (
        "benchmark-setup-kwargs-nan",
        ("benchmark", "emt", "--root", "{root}", "--setup-kwargs", '{"x": NaN}'),
        2,
    ),
    # serve --socket
    (
        "serve-socket-too-long",
        ("serve", "emt", "--root", "{root}", "--socket", "/tmp/" + "s" * 200),
        2,
    ),
    ("serve-socket-empty", ("serve", "emt", "--root", "{root}", "--socket", ""), 2),
    (
        "serve-socket-no-dir",
        ("serve", "emt", "--root", "{root}", "--socket", "{tmp}/nodir/s.sock"),
        2,
    ),
    ("serve-socket-a-dir", ("serve", "emt", "--root", "{root}", "--socket", "{tmp}"), 2),
    # roots and paths
    ("status-empty-root", ("status", "--root", ""), 2),
    ("status-blank-cache-root", ("status", "--root", "{root}", "--cache-root", " "), 2),
    ("manifest-init-empty-root", ("manifest", "init", "--root", "", "--cluster", "box"), 2),
    ("check-perms-empty-root", ("check-perms", ""), 2),
    ("status-root-is-a-file", ("status", "--root", "{afile}"), 2),
    ("list-root-missing", ("list", "--root", "{tmp}/nonexistent"), 1),
    ("status-cache-root-is-a-file", ("status", "--root", "{root}", "--cache-root", "{afile}"), 2),
    ("root-given-twice", ("manifest", "show", "--root", "{root}", "--root", "{afile}"), 2),
    ("init-populated-root", ("init", "--root", "{root}", "--yes", "--cluster", "box"), 1),
    ("init-root-under-a-file", ("init", "--root", "{afile}/x", "--yes", "--cluster", "box"), 1),
    # NUL bytes (a Python caller can pass one; a shell cannot)
    ("nul-in-root", ("status", "--root", "a\x00b"), 2),
    ("nul-in-checkpoint", ("add", "emt\x00", "--root", "{root}"), 2),
    ("nul-in-env-name", ("new-env", "a\x00b"), 2),
    ("nul-in-socket", ("serve", "emt", "--root", "{root}", "--socket", "s\x00.sock"), 2),
    # unknown ids, names and options
    ("add-unknown-id", ("add", "nope", "--root", "{root}"), 2),
    ("add-very-long-id", ("add", "x" * 5000, "--root", "{root}"), 2),
    ("add-empty-id", ("add", "", "--root", "{root}"), 2),
    ("smoke-test-unknown-env", ("smoke-test", "--root", "{root}", "--env", "nope"), 2),
    ("smoke-test-unicode-env", ("smoke-test", "--root", "{root}", "--env", "ünï"), 2),
    ("smoke-test-empty-checkpoint", ("smoke-test", "--root", "{root}", "--checkpoint", ""), 2),
    ("install-empty-target", ("install", "", "--root", "{root}"), 2),
    ("install-unknown-env", ("install", "nope", "--root", "{root}", "--force"), 2),
    ("serve-empty-id", ("serve", "", *SOCKET, "--root", "{root}"), 2),
    ("new-env-path-name", ("new-env", "../evil"), 2),
    ("new-env-unicode-name", ("new-env", "ünï"), 2),
    ("new-env-existing-file", ("new-env", "ok", "-o", "{afile}"), 1),
    ("unknown-option", ("status", "--root", "{root}", "--json", "--json", "--bogus"), 2),
    ("missing-required-option", ("manifest", "init", "--root", "{root}"), 2),
    ("setup-perms-no-group", ("setup-perms", "{root}", "--apply"), 2),
    ("unknown-command", ("bogus-command",), 2),
]


@pytest.mark.parametrize(("argv", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_odd_command_lines_fail_cleanly_and_change_nothing(site: Site, capsys, argv, code):
    before = snapshot(site.tmp)
    got, output = run(capsys, site.fill(argv))
    assert got == code, output
    assert ERROR_LINE.search(output), output
    assert "Traceback" not in output
    assert snapshot(site.tmp) == before


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


# --- cluster names -------------------------------------------------------------------


def test_manifest_init_refuses_a_bad_name_before_writing_a_manifest(site: Site, capsys):
    (site.root / "manifest.json").unlink()
    code, output = run(
        capsys, ["manifest", "init", "--root", str(site.root), "--cluster", "Bad Name!"]
    )
    assert code == 2
    # Refused where click parses it, not later by the manifest writer.
    assert "Invalid value for '--cluster': 'Bad Name!' is not a valid cluster name" in output
    assert not (site.root / "manifest.json").exists()


CLUSTER_COMMANDS = [
    ("status", "--root", "{root}"),
    ("list", "--root", "{root}"),
    ("resolve", "--root", "{root}"),
    ("add", "emt", "--root", "{root}"),
    ("smoke-test", "--root", "{root}"),
    ("install", "emt", "--root", "{root}", "--dry-run"),
    ("serve", "emt", *SOCKET, "--root", "{root}"),
    ("benchmark", "emt", "--root", "{root}"),
    ("manifest", "show", "--root", "{root}"),
    ("manifest", "push", "--root", "{root}"),
    ("manifest", "init", "--root", "{root}"),
    ("init", "--root", "{tmp}/new", "--yes"),
    ("check-perms", "{root}"),
    ("setup-perms", "{root}", "--group", "g"),
]


@pytest.mark.parametrize("command", CLUSTER_COMMANDS, ids=lambda c: "-".join(c[:2]))
@pytest.mark.parametrize("name", ["Bad Name!", "", "a/b", "x" * 65, "ünï", "-x"])
def test_every_cluster_option_follows_the_one_rule(site: Site, capsys, command, name):
    before = snapshot(site.tmp)
    code, output = run(capsys, site.fill((*command, "--cluster", name)))
    assert code == 2, output
    assert "Invalid value for '--cluster'" in output
    assert snapshot(site.tmp) == before


def test_cluster_names_are_case_insensitive_and_stripped(site: Site, capsys):
    capsys.readouterr()
    code = main(["resolve", "--root", str(site.root), "--cluster", " Box ", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert json.loads(out)["cluster"] == "box"


# --- devices -------------------------------------------------------------------------

DEVICE_COMMANDS = [
    ("add", "emt", "--root", "{root}"),
    ("smoke-test", "--root", "{root}"),
    ("serve", "emt", *SOCKET, "--root", "{root}"),
    ("benchmark", "emt", "--root", "{root}"),
]


@pytest.mark.parametrize("command", DEVICE_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize(
    "device", ["../../etc", "cuda/0", "cuda 0", "", "CUDA", "cuda:", "cuda:-1", "tpu", "cpu:0"]
)
def test_every_device_option_follows_the_one_rule(site: Site, capsys, command, device):
    before = snapshot(site.tmp)
    code, output = run(capsys, site.fill((*command, "--device", device)))
    assert code == 2, output
    assert "Invalid value for '--device'" in output
    assert snapshot(site.tmp) == before


@pytest.mark.parametrize(
    "device",
    ["cpu", "cuda", "cuda:0", "cuda:15", "xpu", "xpu:1", "gpu", "gpu:2", "mps", "rocm", "hip"],
)
def test_every_accepted_device_gets_past_parsing(site: Site, capsys, device):
    code, output = run(capsys, ["add", "--list", "--root", str(site.root), "--device", device])
    assert code == 0, output
    assert "Invalid value" not in output


def test_add_with_a_path_as_device_writes_no_manifest_key(site: Site, capsys):
    before = (site.root / "manifest.json").read_bytes()
    code, output = run(
        capsys, ["add", "emt", "--root", str(site.root), "--device", "../../etc", "--no-perm-check"]
    )
    assert code == 2, output
    assert (site.root / "manifest.json").read_bytes() == before


# --- --kwarg JSON ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["[" * 100_000, nested(100)], ids=["100000-open-brackets", "100-deep"]
)
def test_add_refuses_deep_kwarg_json_and_writes_nothing(site: Site, capsys, value):
    before = snapshot(site.tmp)
    code, output = run(
        capsys, ["add", "emt", "--root", str(site.root), "--kwarg", f"heads={value}"]
    )
    assert code == 2, output
    assert f"--kwarg heads: the JSON value is nested deeper than {MAX_KWARG_DEPTH} levels" in output
    assert "RecursionError" not in output and "Traceback" not in output
    assert snapshot(site.tmp) == before


# --- serve --socket --------------------------------------------------------------------


def test_serve_refuses_a_socket_path_over_sun_path_before_starting_anything(
    site: Site, capsys, monkeypatch
):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(site.tmp))
    long_path = "/tmp/" + "s" * 200
    code, output = run(capsys, ["serve", "emt", "--root", str(site.root), "--socket", long_path])
    assert code == 2, output
    assert f"is {len(long_path)} bytes" in output
    assert f"at most {SUN_PATH_MAX_BYTES} bytes" in output
    assert f"hint: bind the server in a shorter directory, e.g. {site.tmp}/ipi_NAME" in output
    # The fake env has no interpreter: getting as far as the spawn would say so instead.
    assert "interpreter" not in output


def test_the_socket_limit_is_107_bytes_of_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    room = SUN_PATH_MAX_BYTES - len(os.fsencode(tmp_path)) - 1
    fits = tmp_path / ("f" * room)
    assert check_socket_path(fits) == fits
    from rootstock.errors import UsageError

    with pytest.raises(UsageError, match=f"is {SUN_PATH_MAX_BYTES + 1} bytes"):
        check_socket_path(str(fits) + "x")
    # A short relative name is measured where it lands: in a deep working directory.
    deep = tmp_path / ("d" * (room - 2))
    deep.mkdir()
    monkeypatch.chdir(deep)
    with pytest.raises(UsageError, match="a Unix socket path is at most 107 bytes"):
        check_socket_path("s.sock")
