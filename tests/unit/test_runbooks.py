"""Every ``rootstock ...`` line in ``scripts/runbooks/*.md`` parses against the real CLI.

The runbooks are copied into terminals on clusters this suite never sees, so a
renamed flag must fail here, naming the runbook line, rather than there. Lines are
parsed with click (``make_context``), never run: nothing is created or contacted.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from rootstock.cli.main import cli

pytestmark = pytest.mark.timeout(60)

RUNBOOKS = sorted((Path(__file__).resolve().parents[2] / "scripts" / "runbooks").glob("*.md"))
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^\s*```\s*([\w+-]*)")
_PLACEHOLDER = re.compile(r"<([A-Za-z0-9_.-]+)>")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*\s+")
_SHELL_OPERATOR = re.compile(r"^[|&;<>()]+$")


@dataclass(frozen=True)
class CommandLine:
    """One ``rootstock`` command from a runbook, and where it is."""

    path: Path
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path.name}:{self.line}: {self.text}"


def command_lines(path: Path, text: str | None = None) -> Iterator[CommandLine]:
    """The ``rootstock ...`` commands in the shell code blocks of a Markdown file.

    A trailing backslash joins the next line; a ``$ `` prompt and leading
    ``VAR=value`` assignments are dropped.
    """
    lines = (path.read_text() if text is None else text).splitlines()
    fence: str | None = None
    pending, start = "", 0
    for number, raw in enumerate(lines, 1):
        opened = _FENCE.match(raw)
        if opened:
            fence = None if fence is not None else opened.group(1).lower()
            pending = ""
            continue
        if fence not in SHELL_FENCES:
            continue
        if not pending:
            start = number
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        logical, pending = (pending + raw).strip(), ""
        if logical.startswith("$ "):
            logical = logical[2:]
        while _ASSIGNMENT.match(logical):
            logical = _ASSIGNMENT.sub("", logical, count=1)
        if logical.startswith("rootstock "):
            yield CommandLine(path, start, logical)


def shell_words(text: str) -> list[str]:
    """Split a command as the shell would, up to the first operator or comment.

    ``<name>`` placeholders become plain words; ``$VAR`` stays as written (click
    sees a literal string, which is all parsing needs).
    """
    text = _PLACEHOLDER.sub(lambda m: f"PLACEHOLDER-{m.group(1)}", text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = []
    for word in lexer:
        if _SHELL_OPERATOR.match(word):
            break
        words.append(word)
    return words


def parse_command(words: list[str]) -> click.Context:
    """Parse ``rootstock WORDS...`` down to the leaf command; raise click's error."""
    if not words or words[0] != "rootstock":
        raise click.UsageError(f"not a rootstock command: {words!r}")
    ctx = cli.make_context("rootstock", words[1:])
    command: click.Command = cli
    while isinstance(command, click.Group):
        protected = getattr(ctx, "_protected_args", None)
        if protected is None:
            protected = ctx.protected_args
        name, sub, rest = command.resolve_command(ctx, [*protected, *ctx.args])
        if sub is None:  # resolve_command raises for unknown names; be explicit anyway
            raise click.UsageError(f"no such command {name!r}")
        ctx = sub.make_context(name, rest, parent=ctx)
        command = sub
    return ctx


def all_commands() -> list[CommandLine]:
    return [c for path in RUNBOOKS for c in command_lines(path)]


# --- the runbooks -----------------------------------------------------------------


def test_there_are_runbooks_with_commands():
    names = {p.name for p in RUNBOOKS}
    assert {"example-cluster.md", "perlmutter.md", "sophia-polaris.md"} <= names
    for path in RUNBOOKS:
        assert list(command_lines(path)), f"{path.name} has no rootstock commands"


@pytest.mark.parametrize("command", all_commands(), ids=str)
def test_runbook_command_parses(command: CommandLine):
    try:
        parse_command(shell_words(command.text))
    except click.ClickException as exc:
        pytest.fail(f"{command}\n  does not parse: {exc.format_message()}")


@pytest.mark.parametrize("name", ["perlmutter.md", "sophia-polaris.md"])
def test_cluster_runbook_sequences_the_whole_bring_up(name: str):
    path = next(p for p in RUNBOOKS if p.name == name)
    commands = list(command_lines(path))
    order = [c.text.split()[1] for c in commands]
    for step in ("setup-perms", "init", "install", "add", "check-perms"):
        assert step in order, f"{name} never runs rootstock {step}"
    assert order.index("setup-perms") < order.index("init") < order.index("install")
    assert order.index("install") < order.index("add") < order.index("check-perms")
    texts = [c.text for c in commands]
    assert any("setup-perms" in t and "--apply" not in t for t in texts), "no dry run first"
    assert any("setup-perms" in t and "--apply" in t for t in texts)
    assert any(t.startswith("rootstock install") and "--dry-run" in t for t in texts)
    assert any(t.startswith("rootstock add") and "--no-verify" in t for t in texts)
    assert any(t.startswith("rootstock add") and "--no-verify" not in t for t in texts)
    body = path.read_text()
    assert "scripts/check_world_readable.sh" in body
    assert "RootstockCalculator" in body
    assert "unverified" in body.lower()
    assert "example-cluster.md" in body


def test_split_and_shared_specifics():
    perlmutter = (RUNBOOKS[0].parent / "perlmutter.md").read_text()
    assert "UV_LINK_MODE=copy" in perlmutter
    assert "--cache-root" in perlmutter
    shared = [c.text for c in command_lines(RUNBOOKS[0].parent / "sophia-polaris.md")]
    assert any("manifest init" in t and "--cluster sophia --cluster polaris" in t for t in shared)
    for cluster in ("sophia", "polaris"):
        assert any(t.startswith("rootstock add") and f"--cluster {cluster}" in t for t in shared)


# --- the checker itself can fail ------------------------------------------------------


SAMPLE = """\
Some prose mentioning rootstock install in passing.

```bash
rootstock install environments/ \\
    --root "$ROOT" --dry-run   # look first
ZE_AFFINITY_MASK=0 rootstock add uma-s-1p1 --device xpu --cluster aurora
$ rootstock check-perms /shared --group <group> | tee out.txt
echo not rootstock
```

```text
rootstock this is sample output, never parsed
```

```python
print("rootstock in python is not a command")
```
"""


def test_extraction_joins_continuations_and_skips_other_blocks(tmp_path: Path):
    found = list(command_lines(tmp_path / "sample.md", SAMPLE))
    assert [c.line for c in found] == [4, 6, 7]
    assert found[0].text.startswith("rootstock install environments/ ")
    assert shell_words(found[0].text) == [
        "rootstock",
        "install",
        "environments/",
        "--root",
        "$ROOT",
        "--dry-run",
    ]
    assert shell_words(found[1].text)[:3] == ["rootstock", "add", "uma-s-1p1"]
    assert shell_words(found[2].text) == [
        "rootstock",
        "check-perms",
        "/shared",
        "--group",
        "PLACEHOLDER-group",
    ]
    for command in found:
        parse_command(shell_words(command.text))


@pytest.mark.parametrize(
    "line",
    [
        "rootstock install environments/ --bogus-flag",
        "rootstock no-such-command",
        "rootstock manifest",  # a group needs its subcommand
        "rootstock manifest frobnicate --cluster x",
        "rootstock manifest init --cluster sophia --colour blue",
        "rootstock setup-perms /shared",  # --group is required
        "rootstock install --dry-run",  # TARGET is required
        "rootstock smoke-test --jobs many",
    ],
)
def test_a_broken_command_is_caught(line: str):
    with pytest.raises(click.ClickException):
        parse_command(shell_words(line))


def test_nested_groups_are_descended():
    ctx = parse_command(shell_words("rootstock manifest init --cluster sophia --cluster polaris"))
    assert ctx.command.name == "init"
    assert ctx.params["clusters"] == ("sophia", "polaris")
    ctx = parse_command(shell_words("rootstock --debug install x --dry-run"))
    assert ctx.params["dry_run"] is True
