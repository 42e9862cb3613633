"""The recipes' shell functions, run by bash directly, for both recipes.

``ROOTSTOCK_NIGHTLY_SOURCE_ONLY=1`` makes a recipe define its functions without
running, so the Hugging Face token lookup and the date arithmetic can be checked case
by case here; test_slurm_nightly.py checks both again through real jobs. The token
lookup must agree with rootstock's own (``rootstock.runtime.worker_env.find_hf_token``),
which the workers use. No service is needed (no ``system`` mark).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rootstock.runtime.worker_env import find_hf_token

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
RECIPES = {
    "sbatch": REPO / "scripts" / "nightly_smoke_test.sbatch",
    "pbs": REPO / "scripts" / "nightly_smoke_test.pbs",
}
REAL_DATE = shutil.which("date")
# `date +%F` answers $FAKE_TODAY; every other call is GNU date's.
DATE_SHIM = f"""#!/bin/sh
if [ "$1" = "+%F" ] && [ -n "$FAKE_TODAY" ]; then echo "$FAKE_TODAY"; exit 0; fi
exec {REAL_DATE} "$@"
"""


def run_function(recipe: str, script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Source ``recipe`` in bash without running it, then run ``script``."""
    return subprocess.run(
        ["bash", "-c", f'source "$1"\n{script}', "bash", str(RECIPES[recipe])],
        env={"PATH": "/usr/bin:/bin", "ROOTSTOCK_NIGHTLY_SOURCE_ONLY": "1", **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


SHOW_TOKENS = """lookup_hf_token
echo "HF_TOKEN=${HF_TOKEN-<unset>}"
echo "HUB=${HUGGING_FACE_HUB_TOKEN-<unset>}"
"""


def lookup(recipe: str, home: Path, env: dict[str, str]) -> tuple[str, str, str]:
    """(HF_TOKEN, HUGGING_FACE_HUB_TOKEN, the function's own log) after ``lookup_hf_token``."""
    proc = run_function(recipe, SHOW_TOKENS, {"HOME": str(home), **env})
    assert proc.returncode == 0, proc.stderr
    *log, hf, hub = proc.stdout.splitlines()
    log_text = "\n".join(log) + proc.stderr
    return hf.removeprefix("HF_TOKEN="), hub.removeprefix("HUB="), log_text


@pytest.fixture
def token_home(tmp_path: Path) -> Path:
    """A HOME holding all three token files, each with surrounding whitespace."""
    home = tmp_path / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".hf_token").write_text("\n  home-token\t\n")
    (home / ".cache" / "huggingface" / "token").write_text("cache-token\n")
    (tmp_path / "token-file").write_text("  file-token  \n")
    return home


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_token_sources_in_order(recipe: str, token_home: Path):
    token_file = str(token_home.parent / "token-file")
    cases = [
        # (what the environment holds, files removed first, expected token, source)
        ({"HF_TOKEN": " env-token ", "HF_TOKEN_FILE": token_file}, [], "env-token", "HF_TOKEN"),
        ({"HF_TOKEN_FILE": token_file}, [], "file-token", token_file),
        ({"HF_TOKEN_FILE": str(token_home / "missing")}, [], "home-token", ".hf_token"),
        ({"HF_TOKEN": " \n"}, [], "home-token", ".hf_token"),  # blank is no token
        ({}, [".hf_token"], "cache-token", ".cache/huggingface/token"),
    ]
    for env, remove, expected, source in cases:
        for name in remove:
            (token_home / name).unlink()
        hf, hub, log = lookup(recipe, token_home, env)
        assert (hf, hub) == (expected, expected), (env, log)
        assert "HF token: from" in log and source in log
        assert expected not in log  # the log names the source, never the token
        assert find_hf_token(env, token_home)[0] == expected  # rootstock agrees


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_no_token_is_a_warning(recipe: str, tmp_path: Path):
    hf, hub, log = lookup(recipe, tmp_path, {"HF_TOKEN_FILE": str(tmp_path / "missing")})
    assert (hf, hub) == ("<unset>", "<unset>")
    assert "WARNING: no Hugging Face token" in log
    assert find_hf_token({}, tmp_path) == (None, None)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_an_empty_token_file_is_passed_over(recipe: str, token_home: Path):
    (token_home / ".hf_token").write_text(" \n")
    hf, _, log = lookup(recipe, token_home, {})
    assert hf == "cache-token", log
    assert find_hf_token({}, token_home)[0] == "cache-token"


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_tilde_in_hf_token_file_means_home(recipe: str, token_home: Path):
    (token_home / "my-token").write_text("tilde-token\n")
    hf, _, _ = lookup(recipe, token_home, {"HF_TOKEN_FILE": "~/my-token"})
    assert hf == "tilde-token"


# (today in the job's zone, CADENCE_DAYS, RUN_HOUR, zone, next date)
DATE_CASES = [
    ("2026-11-29", "7", "2", "UTC0", "2026-12-06"),
    ("2026-12-28", "7", "2", "UTC0", "2027-01-04"),
    ("2028-02-26", "3", "23", "UTC0", "2028-02-29"),
    ("2027-02-26", "3", "0", "UTC0", "2027-03-01"),
    ("2026-03-07", "1", "2", "CST6CDT,M3.2.0,M11.1.0", "2026-03-08"),
    ("2026-10-31", "1", "2", "CST6CDT,M3.2.0,M11.1.0", "2026-11-01"),
    ("2026-05-05", "1", "02", "UTC0", "2026-05-06"),
]


@pytest.fixture
def date_shim(tmp_path: Path) -> str:
    bin_dir = tmp_path / "shim"
    bin_dir.mkdir()
    (bin_dir / "date").write_text(DATE_SHIM)
    (bin_dir / "date").chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize(("today", "cadence", "hour", "zone", "expected"), DATE_CASES)
def test_next_begin_is_the_calendar_date_plus_cadence_at_the_hour(
    recipe: str, date_shim: str, today, cadence, hour, zone, expected
):
    env = {"PATH": date_shim, "FAKE_TODAY": today, "TZ": zone}
    proc = run_function(recipe, "next_begin", {**env, "CADENCE_DAYS": cadence, "RUN_HOUR": hour})
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    hh = f"{int(hour):02d}"
    if recipe == "sbatch":
        assert proc.stdout.strip() == f"{expected}T{hh}:00:00"
    else:
        assert proc.stdout.strip() == expected.replace("-", "") + f"{hh}00"


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_midnight_dst_change_does_not_shift_the_date(recipe: str, date_shim: str):
    # Chile moves its clocks at midnight: 2026-09-06 00:00 does not exist in Santiago.
    if not Path("/usr/share/zoneinfo/America/Santiago").exists():
        pytest.skip("no tzdata for America/Santiago")
    env = {"PATH": date_shim, "FAKE_TODAY": "2026-09-05", "TZ": "America/Santiago"}
    proc = run_function(recipe, "next_run_date", {**env, "CADENCE_DAYS": "1"})
    assert proc.stdout.strip() == "2026-09-06", proc.stderr


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize(
    ("knob", "value"), [("CADENCE_DAYS", "0"), ("CADENCE_DAYS", "weekly"), ("RUN_HOUR", "24")]
)
def test_a_bad_knob_falls_back_to_its_default_with_a_warning(
    recipe: str, date_shim: str, knob: str, value: str
):
    env = {"PATH": date_shim, "FAKE_TODAY": "2026-11-29", "TZ": "UTC0", knob: value}
    proc = run_function(recipe, "next_begin", env)
    assert proc.returncode == 0
    expected = "2026-12-06T02:00:00" if recipe == "sbatch" else "202612060200"
    assert proc.stdout.strip() == expected
    assert f"WARNING: {knob}={value} is not an integer" in proc.stderr


SHARED_FUNCTIONS = [
    "checked_int", "next_run_date", "with_retries", "strip", "lookup_hf_token",
    "run_smoke_test", "log", "warn", "rehash_stamp", "rehash_due",
]  # fmt: skip


def function_source(text: str, name: str) -> str:
    """The definition of shell function ``name`` (one line, or up to its closing brace)."""
    found = re.search(rf"^{name}\(\) \{{(?:[^\n]*\}}$|\n.*?^\}}$)", text, re.M | re.S)
    assert found, f"{name}() not found"
    return found.group(0)


def test_the_logic_both_recipes_share_is_the_same_text():
    # Each recipe must stand alone (a copied file runs from the scheduler's spool),
    # so the shared functions are repeated; this keeps the two copies identical.
    sbatch, pbs = (RECIPES[k].read_text() for k in ("sbatch", "pbs"))
    for name in SHARED_FUNCTIONS:
        assert function_source(sbatch, name) == function_source(pbs, name), name


# A stand-in `rootstock` that logs its arguments and exits with $FAKE_RC.
FAKE_ROOTSTOCK = """#!/bin/sh
echo "$@" >> "$ARGS_LOG"
exit "${FAKE_RC:-0}"
"""


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_weights_are_rehashed_once_a_week(recipe: str, tmp_path: Path):
    home, bin_dir, root = tmp_path / "home", tmp_path / "bin", tmp_path / "root"
    for directory in (home, bin_dir, root):
        directory.mkdir()
    (bin_dir / "rootstock").write_text(FAKE_ROOTSTOCK)
    (bin_dir / "rootstock").chmod(0o755)
    args_log = tmp_path / "args"
    env = {
        "HOME": str(home),
        "ARGS_LOG": str(args_log),
        "ROOTSTOCK_ROOT": str(root),
        "JOB_NAME": "chain-a",
    }
    script = f'PATH="{bin_dir}:$PATH"; run_smoke_test; echo "rc=$?"'
    stamp = home / ".rootstock-nightly-rehash-chain-a"

    def run(**extra: str) -> tuple[str, str]:
        proc = run_function(recipe, script, {**env, **extra})
        last_args = args_log.read_text().splitlines()[-1]
        return last_args, proc.stdout.splitlines()[-1]

    # Never re-hashed: this run does, and a run that ran (exit 0 or 1) stamps it.
    assert run(FAKE_RC="1") == (f"smoke-test --root {root} --rehash", "rc=1")
    assert stamp.exists()
    # The next run, within the week: a stat check only.
    assert run() == (f"smoke-test --root {root}", "rc=0")
    # Six and a half days later and a bit: due again (twelve hours of slack).
    old = stamp.stat().st_mtime - 6.6 * 86400
    os.utime(stamp, (old, old))
    assert run()[0].endswith("--rehash")
    # A run that could not run (exit 2) leaves the stamp alone, so the next one re-hashes.
    os.utime(stamp, (old, old))
    assert run(FAKE_RC="2")[0].endswith("--rehash")
    assert run()[0].endswith("--rehash")
    # REHASH_DAYS=0 turns it off; another chain (JOB_NAME) keeps its own stamp.
    stamp.unlink()
    assert not run(REHASH_DAYS="0")[0].endswith("--rehash")
    assert run(JOB_NAME="chain-b")[0].endswith("--rehash")
    assert (home / ".rootstock-nightly-rehash-chain-b").exists() and not stamp.exists()
