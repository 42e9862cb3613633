"""Numeric options are checked where click parses them: exit code 2, nothing run.

Each command is run in-process through :func:`rootstock.cli.main.main` with no
install root at all: a value that got past parsing would reach the command body
and fail there with exit code 1 ("no install root"), so exit code 2 plus the
option's name in the message proves the check happened at parse time.
"""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from rootstock.cli.main import main
from rootstock.cli.options import (
    JOBS,
    MAX_JOBS,
    MAX_SECONDS,
    PORT,
    Count,
    Seconds,
    timeout_seconds,
)

pytestmark = pytest.mark.timeout(60)

BAD_SECONDS = ["0", "-1", "nan", "NaN", "inf", "-inf", "1e308", "1e400", str(10**12), "abc", ""]
BAD_COUNTS = ["0", "-1", "1.5", "1e3", "x", "nan", "inf", "1e400", "99999999999999999999999"]


@pytest.fixture(autouse=True)
def no_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No config and no root: any command that got past parsing fails with exit 1."""
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    monkeypatch.chdir(tmp_path)


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


TIMEOUTS = [
    ("add", "emt", "--verify-timeout"),
    ("add", "emt", "--download-timeout"),
    ("smoke-test", "--verify-timeout"),
    ("benchmark", "emt", "--timeout"),
    ("serve", "emt", "--socket", "s.sock", "--connect-timeout"),
]


@pytest.mark.parametrize(
    ("command", "value"),
    [
        (command, value)
        for command in TIMEOUTS
        for value in BAD_SECONDS
        # serve --connect-timeout 0 means "retry forever" (test_good_values...).
        if not (command[0] == "serve" and value == "0")
    ],
    ids=lambda p: p if isinstance(p, str) else "-".join(p[:1] + p[-1:]),
)
def test_every_timeout_rejects_non_positive_non_finite_and_huge(capsys, command, value):
    code, err = run(capsys, *command, value)
    assert code == 2, err
    assert f"Invalid value for '{command[-1]}'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "command",
    [
        ("smoke-test", "--jobs"),
        ("smoke-test", "--push-every"),
        ("benchmark", "emt", "--calls"),
        ("dashboard", "serve", "--max-body"),
    ],
    ids=lambda c: "-".join(c[:1] + c[-1:]),
)
@pytest.mark.parametrize("value", BAD_COUNTS)
def test_every_count_rejects_zero_fractions_and_overflow(capsys, command, value):
    code, err = run(capsys, *command, value)
    assert code == 2, err
    assert f"Invalid value for '{command[-1]}'" in err


@pytest.mark.parametrize(
    ("command", "value"),
    [
        (("benchmark", "emt", "--warmup"), "-1"),
        (("smoke-test", "--jobs"), str(MAX_JOBS + 1)),
        (("dashboard", "serve", "--port"), "65536"),
        (("dashboard", "serve", "--port"), "-1"),
        (("dashboard", "serve", "--max-body"), "1023"),
    ],
)
def test_ranges_are_closed_at_both_ends(capsys, command, value):
    code, err = run(capsys, *command, value)
    assert code == 2, err
    assert "out of range" in err


@pytest.mark.parametrize(
    ("command", "value"),
    [
        (("smoke-test", "--jobs"), str(10**12)),
        (("smoke-test", "--push-every"), str(10**12)),
        (("benchmark", "emt", "--calls"), str(10**12)),
        (("benchmark", "emt", "--warmup"), str(10**12)),
        (("dashboard", "serve", "--port"), str(10**12)),
    ],
    ids=lambda p: p if isinstance(p, str) else p[-1],
)
def test_a_trillion_is_out_of_every_count_range(capsys, command, value):
    code, err = run(capsys, *command, value)
    assert code == 2, err
    assert f"Invalid value for '{command[-1]}'" in err and "out of range" in err


@pytest.mark.parametrize("count", ["0", "-1", "nan", "inf", "1e400", str(10**12), "abc", ""])
def test_benchmark_system_atom_count_is_range_checked_before_anything(capsys, count):
    # El:N is parsed before any root is looked up: exit 2 even with no install root.
    code, err = run(capsys, "benchmark", "emt", "--system", f"Cu:{count}")
    assert code == 2, err
    assert "--system 'Cu:" in err and "Traceback" not in err


def test_good_values_get_past_parsing(capsys):
    # With no root, a parsed command fails in its body (exit 1), not in parsing.
    for argv in (
        ("add", "emt", "--verify-timeout", "0.5"),
        ("smoke-test", "--jobs", "2", "--verify-timeout", "1e4", "--push-every", "3"),
        ("serve", "emt", "--socket", "s.sock", "--connect-timeout", "0", "--structure", __file__),
    ):
        code, err = run(capsys, *argv)
        assert code == 1 and "Invalid value" not in err, (argv, err)


def test_seconds_type():
    seconds = Seconds()
    assert seconds.convert("2.5", None, None) == 2.5
    assert seconds.convert(600.0, None, None) == 600.0
    assert seconds.convert(str(MAX_SECONDS), None, None) == MAX_SECONDS
    for bad in ("0", "-0.0", "nan", "inf", "1e308", True, None):
        with pytest.raises(click.BadParameter):
            seconds.convert(bad, None, None)
    forever = timeout_seconds(zero_means="retry forever")
    assert forever.convert("0", None, None) == 0.0
    with pytest.raises(click.BadParameter, match="or 0: retry forever"):
        forever.convert("-1", None, None)


def test_count_type():
    assert JOBS.convert("4", None, None) == 4
    assert JOBS.convert(" 4 ", None, None) == 4
    assert PORT.convert("0", None, None) == 0 and PORT.convert(65535, None, None) == 65535
    for bad in ("4.0", "1e3", "0x10", True, "", str(2**70)):
        with pytest.raises(click.BadParameter):
            Count(1, 10).convert(bad, None, None)
