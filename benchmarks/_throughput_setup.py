"""What ``benchmarks/throughput.py`` stands on: a persistent root of real uv-built
envs, the model run in its own env's Python, and the worker processes' memory."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
IN_ENV_SCRIPT = Path(__file__).resolve().parent / "_throughput_env.py"
ENV_FILES = {
    "emt": REPO / "environments" / "emt.py",
    "null": REPO / "tests" / "envs" / "null_model.py",
    "memory-emt": REPO / "tests" / "envs" / "memory_emt.py",
    "chgnet": REPO / "environments" / "chgnet.py",
}
ROOTSTOCK = [sys.executable, "-m", "rootstock.cli.main"]
LOCAL_WHEELS = Path(os.environ.get("ROOTSTOCK_TEST_WHEELS", "/opt/wheels"))


# --- the root -------------------------------------------------------------------------------


def default_build_dir() -> Path:
    """``$ROOTSTOCK_BENCH_DIR``, else ``~/.cache/rootstock-bench/throughput``."""
    if os.environ.get("ROOTSTOCK_BENCH_DIR"):
        return Path(os.environ["ROOTSTOCK_BENCH_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "rootstock-bench" / "throughput"


def user_uv_cache() -> Path:
    """uv's own cache for this user: the tests' family builds fill it, so it is warm."""
    if os.environ.get("UV_CACHE_DIR"):
        return Path(os.environ["UV_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "uv"


def torch_pin(work: Path) -> list[str]:
    """``install`` options that take the machine's CPU torch wheel, as the tests do.

    find-links alone would lose to PyPI's newer CUDA build, hence the exact pin.
    """
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    wheels = sorted(LOCAL_WHEELS.glob(f"torch-*-{tag}-*.whl"))
    if not wheels:
        return []
    constraint = work / "torch-constraint.txt"
    constraint.write_text(f"torch=={wheels[-1].name.split('-')[1]}\n")
    return ["--find-links", str(wheels[-1].parent), "--constraint", str(constraint)]


def _stale(root: Path, name: str, source: str, rootstock_version: str) -> bool:
    """True unless ``name`` is built from ``source`` with this checkout's rootstock.

    The worker runs the rootstock vendored into the env at build time, so a
    changed checkout needs a rebuild for its worker changes to be measured.
    """
    registered = root / "environments" / f"{name}.py"
    metadata = root / "envs" / name / "rootstock-env.json"
    if not (registered.is_file() and metadata.is_file()):
        return True
    built_with = json.loads(metadata.read_text()).get("versions", {}).get("rootstock")
    return registered.read_text() != source or built_with != rootstock_version


def _install(root: Path, env_file: Path, force: bool, extra: list[str], timeout: float) -> None:
    cmd = [*ROOTSTOCK, "install", str(env_file), "--root", str(root), "--no-push"]
    cmd += ["--no-perm-check", *(["--force"] if force else []), *extra]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")


def build_root(root: Path, names: list[str], work: Path, timeouts: dict[str, float]) -> list[str]:
    """Build (or rebuild) what is stale among ``names`` in ``root``; return what was built."""
    from rootstock.install.vendor import build_wheel_bytes

    if not (root / "layout.json").is_file():
        root.parent.mkdir(parents=True, exist_ok=True)
        init = [*ROOTSTOCK, "init", "--root", str(root), "--cluster", "bench", "--yes"]
        subprocess.run(init, check=True, capture_output=True, timeout=120)
    link = root / ".uv-cache"
    if not link.exists():
        link.symlink_to(user_uv_cache())
    version = build_wheel_bytes()[0].split("-")[1]
    staging = work / "env-files"
    staging.mkdir(exist_ok=True)
    built = []
    for name in names:
        source = ENV_FILES[name].read_text()
        if not _stale(root, name, source, version):
            continue
        env_file = staging / f"{name}.py"  # the env takes its name from the file
        env_file.write_text(source)
        extra = torch_pin(work) if name == "chgnet" else []
        exists = (root / "envs" / name).exists()
        print(f"building {name} into {root} ...", file=sys.stderr)
        _install(root, env_file, exists, extra, timeouts.get(name, 900))
        built.append(name)
    return built


def prepare_root(args: argparse.Namespace, quick: bool, work: Path) -> tuple[Path, bool, str]:
    """(the root, whether CHGNet is there, a note for the report)."""
    if args.root:
        root = Path(args.root)
        chgnet = not args.no_chgnet and (root / "envs" / "chgnet").exists()
        return root, chgnet, "" if chgnet or args.no_chgnet else f"no chgnet env in {root}"
    root = Path(args.build_dir) if args.build_dir else default_build_dir()
    build_root(root, ["emt", "null", "memory-emt"], work, {})
    if args.no_chgnet:
        return root, False, "CHGNet skipped (--no-chgnet)"
    timeout = args.build_timeout or (300.0 if quick else 2400.0)
    try:
        build_root(root, ["chgnet"], work, {"chgnet": timeout})
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        if not quick:
            raise
        first = str(exc).strip().splitlines()[0]
        return root, False, f"CHGNet not built within {timeout:.0f} s ({first}): EMT only"
    return root, True, ""


# --- the model in its own env ---------------------------------------------------------------


class InEnvModel:
    """The env's ``setup()`` model in the env's own Python, timed on command.

    It runs with the environment a worker of that env gets, so the only
    difference from the worker is Rootstock itself.
    """

    def __init__(self, spec: Any, cells: Path, timeout: float = 600.0) -> None:
        self.spec, self.cells, self.timeout = spec, cells, timeout
        self.setup_s = 0.0
        self.batched: str | None = None
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> InEnvModel:
        from rootstock.runtime.worker_env import worker_environment

        env = worker_environment(self.spec.layout, self.spec.env_name, offline=True)
        argv = [str(self.spec.python), "-I", str(IN_ENV_SCRIPT), str(self.spec.env_source)]
        argv += [self.spec.checkpoint, self.spec.device, str(self.cells)]
        self._log = (self.cells.parent / f"in-env-{self.spec.env_name}.log").open("w+")
        self._proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,  # the teardown kills whatever the model started
        )
        ready = self._reply()
        self.setup_s, self.batched = ready["setup_s"], ready["batched"]
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is not None:
            try:
                proc.stdin.close()  # type: ignore[union-attr]
                proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._log.close()

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise RuntimeError("InEnvModel is used outside its with block")
        return proc.stdin, proc.stdout

    def _reply(self) -> dict[str, Any]:
        stdout = self._pipes()[1]
        readable, _, _ = select.select([stdout], [], [], self.timeout)
        line = stdout.readline() if readable else ""
        if not line:
            self._log.seek(0)
            tail = self._log.read()[-4000:]
            raise RuntimeError(f"the in-env run of {self.spec.checkpoint} failed:\n{tail}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def _run(self, command: dict[str, Any]) -> tuple[float, list[float]]:
        stdin = self._pipes()[0]
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()
        reply = self._reply()
        return reply["seconds"], reply["energies"]

    def loop(self) -> tuple[float, list[float]]:
        """(iv): seconds for the model's own one-at-a-time loop, and its energies."""
        return self._run({"run": "loop"})

    def batch(self, batch_size: int) -> tuple[float, list[float]]:
        """(iii): seconds for the library's own batched call, and its energies."""
        return self._run({"run": "batch", "batch_size": batch_size})


# --- worker processes -----------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        kids: list[int] = []
        for task in tasks:
            text = (task / "children").read_text()
            kids += [int(p) for p in text.split()]
        return kids
    except OSError:
        return []


def worker_pids() -> list[int]:
    """This process's descendants that run ``python -m rootstock.worker``."""
    found, todo = [], _children(os.getpid())
    while todo:
        pid = todo.pop()
        todo += _children(pid)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rootstock.worker" in argv:
            found.append(pid)
    return sorted(found)


def worker_rss_mb(pids: list[int]) -> float:
    """The summed VmRSS of ``pids``, in MB (10^6 bytes)."""
    total_kib = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
        except OSError:
            continue
    return total_kib * 1024 / 1e6


@contextlib.contextmanager
def private_workspace(prefix: str) -> Iterator[Path]:
    """A temp dir for one benchmark run, removed at the end, with its own
    ``$XDG_RUNTIME_DIR`` and config: the pool daemons the run starts live there, so
    stopping them at the end can never touch anyone else's. Its workers stage their
    builds in it too (``$ROOTSTOCK_STAGE_DIR``), and the stages are removed with it."""
    from rootstock.runtime.stage_dir import STAGE_DIR_ENV, clean_stages

    work = Path(tempfile.mkdtemp(prefix=prefix))
    runtime = work / "xdg-runtime"
    runtime.mkdir(mode=0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    stages = work / "stages"
    stages.mkdir()
    os.environ[STAGE_DIR_ENV] = str(stages)
    os.environ.setdefault("ROOTSTOCK_CONFIG", str(work / "config.toml"))
    os.environ.pop("ROOTSTOCK_POOL", None)
    try:
        yield work
    finally:
        stopped = stop_pool_daemons(runtime)
        if stopped:
            print(f"warning: {stopped}", file=sys.stderr)
        os.environ[STAGE_DIR_ENV] = str(stages)  # the staged measurements change it
        with contextlib.suppress(Exception):
            clean_stages()
        shutil.rmtree(work, ignore_errors=True)


def stop_pool_daemons(runtime: Path) -> str:
    """Stop the pool daemons of this run; "" when all went.

    Only ever the pool directory under ``runtime`` (this run's own
    ``$XDG_RUNTIME_DIR``), never the user's real one. ``rootstock workers stop
    --all`` first; a daemon that outlives it is ended by the pid its state records.
    """
    from rootstock.runtime.pool.directory import daemon_alive, pool_dir_path, read_states

    directory = pool_dir_path()
    if directory.parent != runtime or not directory.is_dir():
        return ""
    subprocess.run(
        [*ROOTSTOCK, "workers", "stop", "--all"],
        capture_output=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    left = [s for s in read_states(directory) if daemon_alive(s)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [s for s in read_states(directory) if daemon_alive(s)]
    for state in left:
        pid = state["daemon"].get("pid")
        if isinstance(pid, int):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    return f"{len(left)} pool daemon(s) outlived `workers stop --all`" if left else ""
