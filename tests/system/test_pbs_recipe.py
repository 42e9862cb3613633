"""The shipped PBS recipe, unedited, run by bash against a PBS Pro stand-in.

Debian has no PBS server, so ``qsub`` and ``qselect`` on PATH are the stand-in in
``pbs_standin.py`` (a job table in a JSON file), and ``rootstock`` is a stand-in that
records how it was called. :class:`FakePbs` plays the server's part in starting a
job: the environment holds what ``qsub -v`` named plus ``PBS_*`` and the basics, and
the spooled copy of the script runs with bash from ``$HOME``. Time does not pass: a
test starts a waiting (W) job whenever it likes. No service is needed, so these tests
run everywhere (they carry no ``system`` mark).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from datetime import date, timedelta
from pathlib import Path

import pytest

from tests.system.pbs_standin import Server

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "scripts" / "nightly_smoke_test.pbs"
STANDIN = Path(__file__).resolve().parent / "pbs_standin.py"
JOB_TZ = "CST6CDT,M3.2.0,M11.1.0"
ALCF_PROXY = "http://proxy.alcf.anl.gov:3128"

ROOTSTOCK_STANDIN = """#!/bin/bash
# Stand-in for the rootstock CLI: records the call and what the recipe gave it.
echo "rootstock $*" >> @STATE@/events.log
{
    echo "umask=$(umask)"
    echo "http_proxy=${http_proxy-}"
    echo "https_proxy=${https_proxy-}"
    echo "HTTP_PROXY=${HTTP_PROXY-}"
    echo "HTTPS_PROXY=${HTTPS_PROXY-}"
    echo "ROOTSTOCK_ROOT=${ROOTSTOCK_ROOT-}"
} > @STATE@/rootstock-env
outcome=$(cat @STATE@/rootstock-outcome 2>/dev/null || echo 0)
[ "$outcome" = kill ] && kill -KILL $$
exit "$outcome"
"""


class FakePbs:
    """A PBS Pro stand-in: qsub/qselect on PATH, and the server's part in starting jobs."""

    def __init__(self, tmp: Path) -> None:
        self.state = tmp / "pbs"
        self.bin = tmp / "bin"
        self.home = tmp / "home"
        self.submit_dir = tmp / "submit"
        self.root = tmp / "root"
        for path in (self.state, self.bin, self.home, self.submit_dir, self.root):
            path.mkdir()
        for command in ("qsub", "qselect"):
            self.write_tool(
                command, f'#!/bin/sh\nexec {sys.executable} {STANDIN} {self.state} {command} "$@"\n'
            )
        self.write_tool("rootstock", ROOTSTOCK_STANDIN.replace("@STATE@", str(self.state)))
        # The maintainer's copy of the recipe, unedited, in the directory they submit from.
        self.recipe = self.submit_dir / "nightly_smoke_test.pbs"
        shutil.copyfile(RECIPE, self.recipe)
        self.stop_file = self.home / ".rootstock-nightly-stop"

    def write_tool(self, name: str, text: str) -> None:
        path = self.bin / name
        path.write_text(text)
        path.chmod(0o755)

    def base_env(self) -> dict[str, str]:
        return {
            "HOME": str(self.home),
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "TZ": JOB_TZ,
            "USER": os.environ.get("USER", "root"),
            "LOGNAME": os.environ.get("LOGNAME", "root"),
            "LANG": "C.UTF-8",
        }

    def qsub(self, *args: str) -> str:
        """``qsub ARGS nightly_smoke_test.pbs`` from the submit directory; the job id."""
        proc = subprocess.run(
            [str(self.bin / "qsub"), *args, self.recipe.name],
            cwd=self.submit_dir,
            env=self.base_env(),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def kickoff(self, variables: str = "") -> str:
        """The maintainer's kickoff: ``qsub [-v ...] nightly_smoke_test.pbs``."""
        return self.qsub(*(("-v", variables) if variables else ()))

    def jobs(self) -> list[dict]:
        server = Server(self.state)
        try:
            return server.jobs
        finally:
            server.lock.close()

    def job(self, job_id: str) -> dict:
        (found,) = [job for job in self.jobs() if job["id"] == job_id]
        return found

    def set_state(self, job_id: str, state: str) -> None:
        server = Server(self.state)
        try:
            for job in server.jobs:
                if job["id"] == job_id:
                    job["state"] = state
            server.save()
        finally:
            server.lock.close()

    def start(self, job_id: str, extra_env: dict[str, str] | None = None):
        """Run the job as PBS would; the completed process (stdout holds the job's log)."""
        job = self.job(job_id)
        env = {
            **self.base_env(),
            "PBS_JOBID": job_id,
            "PBS_JOBNAME": job["name"],
            "PBS_O_WORKDIR": job["workdir"],
            "PBS_O_HOME": str(self.home),
            **job["variables"],
            **(extra_env or {}),
        }
        self.set_state(job_id, "R")
        self.event(f"start {job_id}")
        proc = subprocess.run(
            ["bash", job["script"]],
            cwd=self.home,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        self.event(f"end {job_id} {proc.returncode}")
        self.set_state(job_id, "F")
        proc.log = proc.stdout + proc.stderr
        return proc

    def event(self, line: str) -> None:
        with open(self.state / "events.log", "a") as fh:
            fh.write(line + "\n")

    def events(self) -> list[str]:
        path = self.state / "events.log"
        return path.read_text().splitlines() if path.exists() else []

    def submissions(self) -> list[str]:
        return [line for line in self.events() if line.startswith("qsub ")]

    def rootstock_env(self) -> dict[str, str]:
        lines = (self.state / "rootstock-env").read_text().splitlines()
        return dict(line.split("=", 1) for line in lines)

    def set_rootstock_outcome(self, outcome: str) -> None:
        (self.state / "rootstock-outcome").write_text(outcome)

    def today(self) -> date:
        """Today's date in the jobs' time zone."""
        out = subprocess.run(
            ["date", "+%F"], env={"TZ": JOB_TZ}, capture_output=True, text=True, check=True
        )
        return date.fromisoformat(out.stdout.strip())

    def last_job(self) -> dict:
        return self.jobs()[-1]


@pytest.fixture
def pbs(tmp_path: Path) -> FakePbs:
    return FakePbs(tmp_path)


def pbs_time(day: date, hour: int) -> str:
    """qsub -a's CCYYMMDDhhmm."""
    return f"{day:%Y%m%d}{hour:02d}00"


def test_resubmits_first_with_the_exact_start_time_and_its_knobs(pbs: FakePbs):
    knobs = f"CADENCE_DAYS=3,RUN_HOUR=5,ROOTSTOCK_ROOT={pbs.root},PUSH_EVERY=5"
    first = pbs.kickoff(knobs + ",SMOKE_TEST_ARGS=--device cpu")
    assert pbs.job(first)["name"] == "rootstock-nightly"  # from the #PBS -N directive
    day = pbs.today()
    proc = pbs.start(first)
    assert proc.returncode == 0, proc.log
    assert pbs.today() == day, "the test ran across midnight; run it again"

    events = pbs.events()
    submit = next(i for i, line in enumerate(events) if line.startswith("qsub -N"))
    smoke = next(i for i, line in enumerate(events) if line.startswith("rootstock "))
    assert submit < smoke, events  # resubmit first
    # The chain has never re-hashed the weights (no stamp in its HOME): this run does.
    assert events[smoke] == (
        f"rootstock smoke-test --root {pbs.root} --push-every 5 --rehash --device cpu"
    )

    nxt = pbs.last_job()
    assert nxt["a"] == pbs_time(day + timedelta(days=3), 5)
    assert nxt["state"] == "W"
    assert nxt["name"] == "rootstock-nightly"
    assert nxt["submitted_from"] == str(pbs.recipe)
    assert nxt["workdir"] == str(pbs.submit_dir)
    assert nxt["variables"] == {
        "CADENCE_DAYS": "3",
        "RUN_HOUR": "5",
        "ROOTSTOCK_ROOT": str(pbs.root),
        "PUSH_EVERY": "5",
        "SMOKE_TEST_ARGS": "--device cpu",
    }
    assert f"resubmit: queued job {nxt['id']} (rootstock-nightly)" in proc.log
    assert pbs.rootstock_env()["umask"] == "0002"


def test_reschedule_at_is_one_shot(pbs: FakePbs):
    at = subprocess.run(
        ["date", "-d", "+3 minutes", "+%m%d%H%M"],
        env={"TZ": JOB_TZ},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    first = pbs.kickoff(f"RESCHEDULE_AT={at},CADENCE_DAYS=2,ROOTSTOCK_ROOT={pbs.root}")
    proc = pbs.start(first)
    assert proc.returncode == 0, proc.log
    second = pbs.last_job()
    assert second["a"] == at and second["state"] == "W"
    assert "one-shot override RESCHEDULE_AT" in proc.log
    # qsub -v passes only what it names: the override is not among them.
    assert second["variables"] == {"CADENCE_DAYS": "2", "ROOTSTOCK_ROOT": str(pbs.root)}

    day = pbs.today()
    proc = pbs.start(second["id"])  # time passes: the waiting run starts
    assert proc.returncode == 0, proc.log
    assert "RESCHEDULE_AT=(unset)" in proc.log and "one-shot override" not in proc.log
    third = pbs.last_job()
    assert third["id"] != second["id"]
    assert third["a"] == pbs_time(day + timedelta(days=2), 2)
    assert third["variables"] == second["variables"]


@pytest.mark.parametrize("waiting_state", ["W", "Q"])
def test_a_waiting_instance_stops_a_duplicate(pbs: FakePbs, waiting_state: str):
    # The chain's next run: W with a future start time, Q once that time has come.
    when = ("-a", pbs_time(pbs.today() + timedelta(days=7), 2)) if waiting_state == "W" else ()
    waiting = pbs.qsub("-N", "rootstock-nightly", *when, "-v", f"ROOTSTOCK_ROOT={pbs.root}")
    assert pbs.job(waiting)["state"] == waiting_state
    stray = pbs.kickoff(f"ROOTSTOCK_ROOT={pbs.root}")
    submissions = len(pbs.submissions())

    proc = pbs.start(stray)
    assert proc.returncode == 0, proc.log
    assert len(pbs.submissions()) == submissions  # no qsub from the stray
    assert f"resubmit: skipped: job {waiting} (rootstock-nightly) is already pending" in proc.log
    assert any(line.startswith("rootstock smoke-test") for line in pbs.events())
    live = [job["id"] for job in pbs.jobs() if job["state"] in ("W", "Q")]
    assert live == [waiting]


def test_a_lookalike_name_is_not_a_pending_instance(pbs: FakePbs):
    # qstat's listing would show both as "rootstock-"; the recipe matches the full name.
    pbs.qsub("-N", "rootstock-nightly-old", "-a", pbs_time(pbs.today() + timedelta(days=1), 2))
    job = pbs.kickoff(f"ROOTSTOCK_ROOT={pbs.root}")
    proc = pbs.start(job)
    assert proc.returncode == 0, proc.log
    assert pbs.last_job()["name"] == "rootstock-nightly"
    assert pbs.last_job()["id"] != job


def test_the_stop_file_ends_the_chain(pbs: FakePbs):
    first = pbs.kickoff(f"ROOTSTOCK_ROOT={pbs.root}")
    pbs.stop_file.touch()
    proc = pbs.start(first)
    assert proc.returncode == 0, proc.log
    assert len(pbs.submissions()) == 1  # the kickoff only
    assert f"resubmit: skipped: stop file {pbs.stop_file} exists" in proc.log
    assert any(line.startswith("rootstock smoke-test") for line in pbs.events())


@pytest.mark.parametrize("outcome", ["1", "kill"])
def test_a_crashing_smoke_test_still_leaves_the_next_run_queued(pbs: FakePbs, outcome: str):
    pbs.set_rootstock_outcome(outcome)
    first = pbs.kickoff(f"ROOTSTOCK_ROOT={pbs.root}")
    day = pbs.today()
    proc = pbs.start(first)
    assert proc.returncode == (1 if outcome == "1" else 137), proc.log
    nxt = pbs.last_job()
    assert nxt["id"] != first and nxt["state"] == "W"
    assert nxt["a"] == pbs_time(day + timedelta(days=7), 2)


def test_the_outbound_proxy_is_set_only_where_missing(pbs: FakePbs):
    job = pbs.kickoff(f"ROOTSTOCK_ROOT={pbs.root}")
    assert pbs.start(job).returncode == 0
    seen = pbs.rootstock_env()
    assert [seen[k] for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")] == [
        ALCF_PROXY
    ] * 4

    job = pbs.kickoff(f"ROOTSTOCK_ROOT={pbs.root}")
    assert pbs.start(job, {"https_proxy": "http://site-proxy:8080"}).returncode == 0
    seen = pbs.rootstock_env()
    assert seen["http_proxy"] == ALCF_PROXY
    assert seen["https_proxy"] == seen["HTTPS_PROXY"] == "http://site-proxy:8080"


def test_a_knob_with_a_comma_survives_the_variable_list(pbs: FakePbs):
    root = pbs.root.parent / "root,with,commas"
    root.mkdir()
    first = pbs.kickoff(f"ROOTSTOCK_ROOT='{root}'")
    assert pbs.job(first)["variables"] == {"ROOTSTOCK_ROOT": str(root)}
    proc = pbs.start(first)
    assert proc.returncode == 0, proc.log
    assert pbs.last_job()["variables"] == {"ROOTSTOCK_ROOT": str(root)}
    assert pbs.rootstock_env()["ROOTSTOCK_ROOT"] == str(root)


def test_an_unreadable_recipe_fails_the_job_but_still_smoke_tests(pbs: FakePbs):
    first = pbs.kickoff(f"ROOTSTOCK_ROOT={pbs.root}")
    pbs.recipe.unlink()  # moved away after the kickoff, and no RECIPE set
    proc = pbs.start(first)
    assert proc.returncode == 1, proc.log
    assert "resubmit: FAILED" in proc.log and "set RECIPE" in proc.log
    assert any(line.startswith("rootstock smoke-test") for line in pbs.events())
