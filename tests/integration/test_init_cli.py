"""``rootstock init`` through the CLI, in a subprocess: config.toml, refusals,
``--force``, and the prompts on a pseudo-terminal (Ctrl-C included).

Moved from tests/unit (which starts no subprocess); the in-process calls of
``init_root`` stay in tests/unit/test_init.py, whose helpers these share.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import stat
import sys
import time
import tomllib

import pytest

from rootstock.install.layout import LAYOUT_VERSION, read_layout
from rootstock.install.machine import resolve_cache_root
from tests.conftest import ROOTSTOCK, run_rootstock
from tests.unit.test_init import register_legacy_cluster, snapshot

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("private_config")]


# --- through the CLI, with no terminal -----------------------------------------------


def test_cli_init_without_tty_never_prompts(tmp_path, private_config):
    root = tmp_path / "root"
    proc = run_rootstock("init", "--root", root, "--cluster", "testbox", timeout=60)
    assert "?" not in proc.stdout and "Cluster name" not in proc.stdout
    assert f"install root: {root}" in proc.stdout
    assert read_layout(root)["layout_version"] == LAYOUT_VERSION
    config = tomllib.loads(private_config.read_text())
    assert config["root"] == str(root)
    assert config["cluster"] == "testbox"
    assert config["is_maintainer"] is False


def test_cli_init_needs_a_root_without_tty(tmp_path):
    proc = run_rootstock("init", "--cluster", "testbox", timeout=60, check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: no install root given")


def test_config_holds_maintainer_fields_with_mode_0600(tmp_path, private_config):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret-value\n")
    root, cache = tmp_path / "root", tmp_path / "cache"
    run_rootstock(
        "init",
        "--root", root,
        "--cache-root", cache,
        "--cluster", "testbox",
        "--maintainer-name", "Ada Lovelace",
        "--maintainer-email", "ada@example.org",
        "--api-url", "https://dash.example.org/api",
        "--api-key", "key-123",
        "--api-secret-file", secret,
        timeout=60,
    )  # fmt: skip
    assert stat.S_IMODE(private_config.stat().st_mode) == 0o600
    config = tomllib.loads(private_config.read_text())
    assert config == {
        "root": str(root),
        "cluster": "testbox",
        "maintainer_name": "Ada Lovelace",
        "maintainer_email": "ada@example.org",
        "is_maintainer": True,
        "api_url": "https://dash.example.org/api",
        "api_key": "key-123",
        "api_secret": "s3cret-value",
    }
    assert read_layout(root)["cache_root"] == str(cache)
    assert "s3cret" not in (root / "layout.json").read_text()
    assert "s3cret" not in (root / "manifest.json").read_text()


def test_cli_refuses_populated_root_and_changes_nothing(tmp_path, private_config):
    root = tmp_path / "root"
    run_rootstock("init", "--root", root, "--cluster", "testbox", timeout=60)
    before, config_before = snapshot(root), private_config.read_bytes()
    proc = run_rootstock(
        "init", "--root", root, "--cluster", "other", "--api-key", "k", timeout=60, check=False
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"error: {root} is already an install root")
    assert "hint:" in proc.stderr and "Traceback" not in proc.stderr
    assert snapshot(root) == before
    assert private_config.read_bytes() == config_before


def test_cli_force_only_adds_what_is_missing(tmp_path):
    root = tmp_path / "root"
    run_rootstock("init", "--root", root, "--cluster", "testbox", timeout=60)
    env = root / "envs" / "emt"
    env.mkdir()
    (env / "env_source.py").write_text("CHECKPOINTS = {}\n")
    manifest = root / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"envs": {}', b'"envs": {"emt": {}}'))
    manifest_bytes, layout_bytes = manifest.read_bytes(), (root / "layout.json").read_bytes()
    (root / "wheels").rmdir()
    (root / "cache").rmdir()

    proc = run_rootstock(
        "init", "--root", root, "--cluster", "testbox", "--force",
        "--cache-root", tmp_path / "elsewhere", timeout=60,
    )  # fmt: skip
    assert manifest.read_bytes() == manifest_bytes
    assert (root / "layout.json").read_bytes() == layout_bytes
    assert (env / "env_source.py").read_text() == "CHECKPOINTS = {}\n"
    assert (root / "wheels").is_dir() and (root / "cache").is_dir()
    assert not (tmp_path / "elsewhere").exists()
    assert f"note: the cache root stays {root}" in proc.stderr
    assert f"cache root:   {root}" in proc.stdout


def test_cli_force_json_reports_created_and_kept(tmp_path):
    root = tmp_path / "root"
    run_rootstock("init", "--root", root, "--cluster", "testbox", timeout=60)
    (root / "wheels").rmdir()
    proc = run_rootstock("init", "--root", root, "--force", "--json", timeout=60)
    doc = json.loads(proc.stdout)
    assert doc["created"] == ["wheels"]
    assert {"layout.json", "manifest.json"} <= set(doc["kept"])
    assert doc["cluster"] == "testbox"  # suggested from the manifest


# --- interactive prompts on a pseudo-terminal ------------------------------------------


class Terminal:
    """Drive ``rootstock init`` on a pseudo-terminal, answering prompts in turn."""

    def __init__(self, args: list[str], env: dict[str, str], deadline_s: float = 60) -> None:
        self.deadline = time.monotonic() + deadline_s
        self.seen = ""
        self.pos = 0
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            try:
                # A runner started in the background ignores SIGINT, and exec keeps
                # that; a user's terminal does not.
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.execve(sys.executable, [sys.executable, *ROOTSTOCK[1:], *args], env)
            finally:
                os._exit(127)

    def _read(self) -> bool:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no expected prompt; the terminal showed:\n{self.seen}")
        ready, _, _ = select.select([self.fd], [], [], min(remaining, 1.0))
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            return False
        if not chunk:
            return False
        self.seen += chunk.decode(errors="replace").replace("\r\n", "\n")
        return True

    def expect(self, text: str) -> None:
        """Wait until ``text`` appears after what was already matched."""
        while text not in self.seen[self.pos :]:
            if not self._read():
                raise AssertionError(f"{text!r} never appeared; the terminal showed:\n{self.seen}")
        self.pos += self.seen[self.pos :].index(text) + len(text)

    def answer(self, prompt: str, reply: str) -> None:
        self.expect(prompt)
        os.write(self.fd, reply.encode() + b"\r")

    def interrupt(self) -> int:
        """Press Ctrl-C until the child exits; return its exit code.

        A SIGINT that lands just before Python blocks in ``read()`` is only noticed at
        the next signal, so keep pressing, as a user would.
        """
        while True:
            os.write(self.fd, b"\x03")  # the terminal turns ^C into SIGINT
            until = time.monotonic() + 1.0
            while time.monotonic() < until:
                if not self._read():
                    return self.finish()

    def finish(self) -> int:
        """Read to the end and return the child's exit code."""
        while self._read():
            pass
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


@pytest.fixture
def terminal():
    started: list[Terminal] = []

    def start(args: list[str]) -> Terminal:
        term = Terminal(args, {**os.environ, "TERM": "dumb"})
        started.append(term)
        return term

    yield start
    for term in started:
        term.kill()


def test_interactive_prompts(tmp_path, private_config, terminal):
    root, cache = tmp_path / "shared" / "rootstock", tmp_path / "scratch" / "cache"
    term = terminal(["init"])
    term.answer("Install root (on a shared filesystem)", str(root))
    term.expect("Model weights can live on a different filesystem")
    term.answer("Cache on a different filesystem?", "y")
    term.answer("Cache root", str(cache))
    term.answer("Cluster name", "MyBox")
    term.answer("Are you a maintainer", "y")
    term.answer("Your name", "Ada Lovelace")
    term.answer("Your email", "ada@example.org")
    term.answer("Dashboard API URL", "https://dash.example.org/api")
    term.answer("API key", "key-123")
    # getpass turns echo off (flushing pending input) before it writes the " " that
    # follows click's "API secret:", so answer only once that space is there.
    term.answer("API secret: ", "s3cret-value")
    term.expect("next: rootstock install")
    assert term.finish() == 0, term.seen
    assert "s3cret-value" not in term.seen  # hidden input is not echoed

    layout = read_layout(root)
    assert layout["layout_version"] == LAYOUT_VERSION
    assert layout["cache_root"] == str(cache)
    assert (cache / "home").is_dir() and (cache / "cache").is_dir()
    assert json.loads((root / "manifest.json").read_text())["clusters"] == ["mybox"]
    assert stat.S_IMODE(private_config.stat().st_mode) == 0o600
    assert tomllib.loads(private_config.read_text()) == {
        "root": str(root),
        "cluster": "mybox",
        "maintainer_name": "Ada Lovelace",
        "maintainer_email": "ada@example.org",
        "is_maintainer": True,
        "api_url": "https://dash.example.org/api",
        "api_key": "key-123",
        "api_secret": "s3cret-value",
    }


def test_interactive_no_separate_cache_declares_the_root(tmp_path, monkeypatch, terminal):
    # The registry suggests a cache root for this root; answering "n" must still win.
    root, cache = tmp_path / "root", tmp_path / "legacy-cache"
    register_legacy_cluster(tmp_path, monkeypatch, root, cache)
    term = terminal(["init", "--root", str(root)])
    term.answer("Cache on a different filesystem?", "n")
    term.answer("Cluster name [oldbox]", "")  # the registry's name is suggested
    term.answer("Are you a maintainer", "n")
    assert term.finish() == 0, term.seen
    assert re.search(r"cache root:\s+" + re.escape(str(root)) + r"\n", term.seen)
    assert read_layout(root)["cache_root"] is None
    assert resolve_cache_root(root, cluster="oldbox") == root  # every reader agrees
    assert not cache.exists()


def test_yes_skips_prompts_even_on_a_terminal(tmp_path, terminal):
    root = tmp_path / "root"
    term = terminal(["init", "--root", str(root), "--cluster", "testbox", "--yes"])
    assert term.finish() == 0, term.seen
    assert "?" not in term.seen
    assert (root / "layout.json").is_file()


def test_ctrl_c_at_a_prompt_exits_130_and_creates_nothing(tmp_path, terminal):
    term = terminal(["init"])
    term.expect("Install root (on a shared filesystem)")
    assert term.interrupt() == 130, term.seen
    assert "Aborted." in term.seen
    assert list(tmp_path.iterdir()) == []
