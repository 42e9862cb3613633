"""No script of ours prints a key, a secret or a token, and ``rootstock init`` never echoes
the ones it is given (issue 31).

The quickstart once traced (``set -x``) its ``rootstock init ... --api-key rsk_...``
line onto the screen. Running the scripts is slow, so their text is read the way bash
would trace it: every command that runs while xtrace is on (``set -x``, ``set -o
xtrace``, a flag set with ``x`` in it, a ``-x`` shebang; ``set +x`` ends it), with its
continuation lines and without comments or here-document bodies (bash traces the
command, not the document). Such a command must not expand a variable named like a
credential (``$API_KEY``, ``${HF_TOKEN}``) nor give a credential option a value
(``--api-key rsk_...``); a credential *file* (``--api-secret-file PATH``) is fine.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from rootstock.cli.main import main

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
SCRIPT_DIRS = (REPO / "scripts", REPO / "scripts" / "dev", REPO / ".ci")
_CREDENTIAL = r"(?:key|secret|token|passw(?:or)?d)"
_CREDENTIAL_VARIABLE = re.compile(rf"\$\{{?[A-Za-z0-9_]*{_CREDENTIAL}[A-Za-z0-9_]*", re.I)
_CREDENTIAL_OPTION = re.compile(rf"--[\w-]*?{_CREDENTIAL}(?![\w-])(?:=|\s+)\S", re.I)
_SET = re.compile(r"^\s*(?:\{\s*)?set\s+(?P<flags>[-+]o\s+xtrace|[-+][A-Za-z]+)\b")
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)(?P<word>[A-Za-z_][A-Za-z0-9_]*)\1")


def shell_scripts() -> list[Path]:
    """Every shell script of ours: a bash or sh shebang in scripts/, scripts/dev or .ci/."""
    found = []
    for folder in SCRIPT_DIRS:
        for path in sorted(folder.iterdir()):
            if path.is_file() and re.match(r"#!.*\b(ba)?sh\b", path.read_text().split("\n")[0]):
                found.append(path)
    return found


def traced_commands(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, command text) of each command bash would trace under xtrace."""
    lines = text.split("\n")
    tracing = bool(re.match(r"#!.*\s-[A-Za-z]*x", lines[0]))
    heredoc_end: str | None = None
    command: list[str] = []
    start = 0
    for number, line in enumerate(lines, 1):
        if heredoc_end is not None:
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        if not command and line.lstrip().startswith("#"):
            continue
        if not command:
            start = number
        command.append(line)
        if line.endswith("\\"):
            continue
        whole = " ".join(part.rstrip("\\") for part in command)
        command = []
        heredoc = _HEREDOC.search(whole)
        if heredoc:
            heredoc_end = heredoc.group("word")
        flags = _SET.match(whole)
        if flags:
            value = flags.group("flags")
            if "xtrace" in value or "x" in value[1:]:
                tracing = value.startswith("-")
                continue
        if tracing:
            yield start, whole


def leaks(text: str) -> list[str]:
    """``line N: command`` for each traced command that would print a credential."""
    return [
        f"line {number}: {command.strip()}"
        for number, command in traced_commands(text)
        if _CREDENTIAL_VARIABLE.search(command) or _CREDENTIAL_OPTION.search(command)
    ]


def test_the_scan_finds_what_xtrace_would_print():
    script = "\n".join(
        [
            "#!/usr/bin/env bash",
            "set -euo pipefail",
            'rootstock init --api-key "$API_KEY"',  # not traced yet
            "set -x",
            "# --api-key in a comment is not traced",
            "rootstock init --root r \\",
            '    --api-key "$API_KEY" --api-secret-file "$DASH/secret"',
            "python - <<'PY'",
            'print("--api-key rsk_in_a_heredoc_body")',
            "PY",
            'curl -H "Authorization: Bearer ${HF_TOKEN}" https://example.org',
            "rootstock init --api-key=rsk_literal",
            "set +x",
            'echo "$API_KEY" >"$DASH/key"',  # not traced any more
        ]
    )
    assert [line.split(":")[0] for line in leaks(script)] == ["line 6", "line 11", "line 12"]
    assert leaks(script.replace("set -x", "set -euxo pipefail"))
    assert leaks(script.replace("set -x", "set -o xtrace"))
    assert len(leaks(script.replace("set +x", "set +o xtrace"))) == 3
    assert len(leaks(script.replace("set +x", "{ set +x; } 2>/dev/null"))) == 3
    assert not leaks(script.replace("set -x", "set -e"))
    assert not leaks('set -x\nrootstock init --api-secret-file "$DASH/secret"\n')


def test_the_scan_reads_every_script():
    names = {path.relative_to(REPO).as_posix() for path in shell_scripts()}
    assert {"scripts/quickstart", "scripts/test", "scripts/dev/bootstrap", ".ci/run"} <= names


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda path: path.name)
def test_no_script_traces_a_credential(script: Path):
    assert leaks(script.read_text()) == []


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_init_never_echoes_the_key_or_the_secret(tmp_path, monkeypatch, capsys, as_json):
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "user" / "config.toml"))
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    key, secret = "rsk_0123456789abcdef", "s3cr3t-9f8e7d6c5b4a"
    secret_file = tmp_path / "secret"
    secret_file.write_text(secret + "\n")
    argv = ["init", "--root", str(tmp_path / "root"), "--cluster", "demo", "--yes"]
    argv += ["--no-images", "--maintainer-email", "you@example.org"]
    argv += ["--api-url", "http://127.0.0.1:9", "--api-key", key]
    argv += ["--api-secret-file", str(secret_file)]
    assert main([*argv, "--json"] if as_json else argv) == 0
    captured = capsys.readouterr()
    shown = captured.out + captured.err
    assert "install root:" in shown or '"root"' in shown, shown
    assert key not in shown and secret not in shown, shown
