"""Drive the shipped SLURM recipe on the local test cluster (scripts/dev/slurm-up).

A :class:`NightlyChain` is one self-scheduling chain under a job name of its own, run
with a private ``HOME`` (so ``~/.rootstock-nightly-stop`` and ``~/.hf_token`` are the
test's) and a private working directory (where every generation writes its log).
Every wait has a deadline; a timeout reports the queue and the logs. ``cancel_all``
is the teardown: it cancels every job of the chain, whoever submitted it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.integration.checkpoint_envs import worker_pids

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "scripts" / "nightly_smoke_test.sbatch"
DEV_VENV = REPO / ".venv"
TERMINAL_STATES = {
    "COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "PREEMPTED",
}  # fmt: skip
# The jobs' local time zone: not the machine's UTC, so a date computed in the wrong
# zone shows. A POSIX rule, so it needs no tzdata.
JOB_TZ = "CST6CDT,M3.2.0,M11.1.0"
QUEUED_RE = re.compile(r"resubmit: queued job (\d+) \((\S+)\) to begin at (\S+)")


def slurm_cmd(*args: str, timeout: float = 30, tz: str | None = None) -> str:
    """Run a SLURM client command; its stdout (raises on failure)."""
    env = {**os.environ, "TZ": tz} if tz else None
    proc = subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def cluster_state() -> str | None:
    """The local node's state per ``sinfo`` (idle, mix, ...), None when SLURM is absent."""
    if shutil.which("sinfo") is None:
        return None
    try:
        return slurm_cmd("sinfo", "-h", "-o", "%t", timeout=15).strip() or "unknown"
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return f"unreachable ({exc})"


@dataclass
class JobInfo:
    """The fields of ``scontrol show job`` the tests read, in the job's time zone."""

    job_id: str
    name: str
    state: str
    exit_code: str
    submit_time: str
    eligible_time: str
    start_time: str
    end_time: str


def job_info(job_id: str) -> JobInfo:
    """``scontrol show job`` for one job (finished jobs stay visible for MinJobAge)."""
    out = slurm_cmd("scontrol", "-o", "show", "job", job_id, tz=JOB_TZ)
    fields = dict(re.findall(r"(\w+)=(\S*)", out))
    return JobInfo(
        job_id=job_id,
        name=fields["JobName"],
        state=fields["JobState"],
        exit_code=fields["ExitCode"],
        submit_time=fields["SubmitTime"],
        eligible_time=fields["EligibleTime"],
        start_time=fields["StartTime"],
        end_time=fields["EndTime"],
    )


def parse_slurm_time(stamp: str) -> float:
    """Epoch seconds of a ``2026-11-29T05:29:07`` stamp printed in ``JOB_TZ``."""
    saved = os.environ.get("TZ")
    os.environ["TZ"] = JOB_TZ
    time.tzset()
    try:
        return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
    finally:
        if saved is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = saved
        time.tzset()


class ChainTimeout(AssertionError):
    """A wait on the chain ran past its deadline."""


class NightlyChain:
    """One chain of the shipped recipe, submitted by the test as a maintainer would."""

    def __init__(self, tmp: Path, root: Path) -> None:
        self.name = f"rs-nightly-{uuid.uuid4().hex[:8]}"
        self.root = root
        self.home = tmp / "home"
        self.workdir = tmp / "jobs"
        self.home.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.stop_file = self.home / ".rootstock-nightly-stop"

    def environment(self, knobs: dict[str, str]) -> dict[str, str]:
        """The submit-time environment: the test's own, a private HOME, and the knobs."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_FILE"}
            and not k.startswith(("SLURM_", "SBATCH_", "RESCHEDULE_", "PYTEST_"))
        }
        env.update(
            HOME=str(self.home),
            TZ=JOB_TZ,
            JOB_NAME=self.name,
            ROOTSTOCK_ROOT=str(self.root),
            ROOTSTOCK_VENV=str(DEV_VENV),
            SMOKE_TEST_ARGS="--device cpu",
        )
        env.update(knobs)
        return env

    def kickoff(self, *sbatch_args: str, **knobs: str) -> str:
        """``KNOB=value sbatch RECIPE`` from the chain's working directory; the job id."""
        proc = subprocess.run(
            ["sbatch", "--parsable", f"--job-name={self.name}", *sbatch_args, str(RECIPE)],
            cwd=self.workdir,
            env=self.environment(knobs),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
        return proc.stdout.strip().split(";")[0]

    def jobs(self, states: str = "all") -> list[tuple[str, str]]:
        """(job id, state) of every job of this chain that SLURM still knows."""
        out = slurm_cmd("squeue", "-h", "-n", self.name, "-t", states, "-o", "%i %T")
        return [tuple(line.split()) for line in out.splitlines() if line.strip()]

    def pending(self) -> list[str]:
        """Ids of the chain's pending jobs."""
        return [job_id for job_id, _state in self.jobs("PENDING")]

    def begin_time(self, job_id: str) -> str:
        """A pending job's start time as ``squeue %S`` prints it, in the jobs' zone."""
        return slurm_cmd("squeue", "-h", "-j", job_id, "-o", "%S", tz=JOB_TZ).strip()

    def log(self, job_id: str) -> str:
        """The job's output file (``#SBATCH --output=%x-%j.out``), or '' before it exists."""
        path = self.workdir / f"{self.name}-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def queued_by(self, job_id: str) -> tuple[str, str]:
        """(next job id, begin) that ``job_id`` says it queued."""
        found = QUEUED_RE.search(self.log(job_id))
        assert found, f"job {job_id} queued no next run:\n{self.log(job_id)}"
        assert found.group(2) == self.name
        return found.group(1), found.group(3)

    def wait_until(self, predicate, timeout: float, what: str, interval: float = 0.5):
        """Poll ``predicate`` until it returns something truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise ChainTimeout(
                    f"timed out after {timeout:.0f} s waiting for {what}\n{self.report()}"
                )
            time.sleep(interval)

    def wait_done(self, job_id: str, timeout: float = 120) -> JobInfo:
        """Wait for the job to reach a terminal state; its info."""

        def finished():
            info = job_info(job_id)
            return info if info.state in TERMINAL_STATES else None

        return self.wait_until(finished, timeout, f"job {job_id} to finish")

    def report(self) -> str:
        """The queue and every log of this chain, for a failure message."""
        parts = ["queue:"]
        with contextlib.suppress(Exception):
            parts.append(slurm_cmd("squeue", "-n", self.name, "-t", "all", "-o", "%i %T %S %r"))
        for path in sorted(self.workdir.glob("*.out")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')}")
        return "\n".join(parts)

    def cancel_all(self, timeout: float = 30) -> None:
        """Cancel every job of this chain and wait until none is left running or queued."""
        with contextlib.suppress(Exception):
            slurm_cmd("scancel", "--name", self.name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                live = self.jobs("PENDING,RUNNING,COMPLETING,CONFIGURING,SUSPENDED")
            except Exception:
                return
            if not live:
                return
            time.sleep(0.5)
        raise ChainTimeout(f"jobs of {self.name} still alive after scancel:\n{self.report()}")


def kill_workers_of(root: Path) -> list[int]:
    """SIGKILL processes whose command line names ``root`` (workers a killed job left)."""
    killed = []
    for pid in worker_pids(root):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed
