"""Test env files and helpers for the checkpoint tests (add, smoke-test, status).

Every env written here depends on exactly what ``environments/emt.py`` depends on,
so a build reuses the session's warm uv cache (about 10 s). Each serves EMT scaled
by a literal ``SCALE``: scaling energy, forces and stress by 1.001 is the drift the
fingerprint must catch, and the built-in reference structure (compressed Cu) keeps
EMT's energy far enough from zero for that to be visible.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import run_rootstock

ENV_HEADER = '''\
"""Test env {name}: EMT scaled by SCALE (written by tests/integration/test_checkpoints.py)."""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "ase>=3.23",
#     "numpy>=1.24",
# ]
# ///

CHECKPOINTS = {checkpoints}
{tables}
SCALE = {scale!r}
'''

SCALED_EMT = '''

def scaled_emt(scale):
    """EMT with energy, forces and stress multiplied by ``scale``."""
    from ase.calculators.calculator import all_changes
    from ase.calculators.emt import EMT

    class ScaledEMT(EMT):
        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, list(properties), system_changes)
            for key in ("energy", "free_energy", "energies", "forces", "stress"):
                if key in self.results:
                    self.results[key] = self.results[key] * scale

    return ScaledEMT()
'''

PLAIN_SETUP = '''

def setup(checkpoint, device="cuda", **kw):
    """EMT scaled by SCALE, for any declared checkpoint."""
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {sorted(CHECKPOINTS)}")
    return scaled_emt(SCALE)
'''

# setup() requires `scale` (1 or 2, an int) and records what it was given in the
# cache root, so a test can read back the exact (JSON-typed) kwargs the worker saw.
KWARG_SETUP = '''

def setup(checkpoint, device="cuda", *, scale, name=None, **kw):
    """EMT for a checkpoint that cannot run without ``scale=1`` or ``scale=2``."""
    import json
    import os

    seen = os.path.join(os.environ["XDG_CACHE_HOME"], "kwargs-seen", checkpoint + ".json")
    os.makedirs(os.path.dirname(seen), exist_ok=True)
    with open(seen, "w") as fh:
        json.dump({"scale": scale, "name": name}, fh)
    if scale not in (1, 2) or isinstance(scale, bool):
        raise ValueError(f"{checkpoint} needs scale=1 or scale=2 (got {scale!r})")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name must be a string (got {name!r})")
    return scaled_emt(SCALE)
'''

# Each checkpoint id is EMT broken one way after the fact (the energy stays EMT's):
# (force scale, stress scale, force noise in eV/Å). 160.2 is GPa reported as eV/Å³;
# 1.2 plus noise stands for a direct force head that only approximates the gradient.
BROKEN_SETUP = """

BREAKAGES = {breakages!r}


def setup(checkpoint, device="cuda", **kw):
    \"\"\"EMT with its forces and stress scaled (and noised) as BREAKAGES says.\"\"\"
    import numpy as np
    from ase.calculators.calculator import all_changes
    from ase.calculators.emt import EMT

    force_scale, stress_scale, noise = BREAKAGES[checkpoint]

    class BrokenEMT(EMT):
        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, list(properties), system_changes)
            rng = np.random.default_rng(0)
            forces = self.results["forces"] * force_scale
            self.results["forces"] = forces + noise * rng.standard_normal(forces.shape)
            if "stress" in self.results:
                self.results["stress"] = self.results["stress"] * stress_scale

    return BrokenEMT()
"""

# download() fetches {"scale": ...} from WEIGHTS_URL into the cache root; setup()
# only reads that file, and refuses to run online.
DOWNLOAD_HOOKS = '''
WEIGHTS_URL = {url!r}


def weights_path(checkpoint):
    """Where the fetched weights file lives: inside the worker's cache root."""
    import os

    return os.path.join(os.environ["XDG_CACHE_HOME"], "fetched-weights", checkpoint + ".json")


def download(checkpoint, **kw):
    """Fetch the weights file over HTTP (the fetch phase of `rootstock add`)."""
    import json
    import os
    import urllib.request

    # Loopback only: never through a site proxy.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({{}}))
    with opener.open(WEIGHTS_URL + "?checkpoint=" + checkpoint, timeout=30) as response:
        weights = json.load(response)
    weights["hf_hub_offline_at_download"] = os.environ.get("HF_HUB_OFFLINE")
    path = weights_path(checkpoint)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".part", "w") as fh:
        json.dump(weights, fh)
    os.replace(path + ".part", path)
    return path


def setup(checkpoint, device="cuda", **kw):
    """EMT scaled by the fetched weights file; verification must run offline."""
    import json
    import os

    offline = os.environ.get("HF_HUB_OFFLINE")
    if offline != "1":
        raise RuntimeError(f"setup() ran with HF_HUB_OFFLINE={{offline!r}}, expected '1'")
    with open(weights_path(checkpoint)) as fh:
        return scaled_emt(json.load(fh)["scale"])
'''


def write_env(
    directory: Path,
    name: str,
    ids: list[str],
    *,
    scale: float = 1.0,
    tables: str = "",
    body: str = PLAIN_SETUP,
) -> Path:
    """Write env file ``{directory}/{name}.py`` serving ``ids`` with EMT x ``scale``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    checkpoints = "{" + ", ".join(f'"{i}": "{i}"' for i in ids) + "}"
    header = ENV_HEADER.format(name=name, checkpoints=checkpoints, tables=tables, scale=scale)
    path.write_text(header + body + SCALED_EMT)
    return path


def write_broken_env(
    directory: Path,
    name: str,
    breakages: dict[str, tuple[float, float, float]],
    tables: str = "",
) -> Path:
    """An env whose ids serve EMT broken as ``breakages[id]`` says (see BROKEN_SETUP)."""
    body = BROKEN_SETUP.format(breakages=breakages)
    return write_env(directory, name, list(breakages), tables=tables, body=body)


def install(root: Path, *env_files: Path) -> None:
    """Build env files into ``root`` with real uv (one ``install`` per file)."""
    for path in env_files:
        run_rootstock("install", path, "--root", root, timeout=600)


def hotfix(root: Path, env: str, edit) -> str:
    """Edit ``envs/<env>/env_source.py`` the maintainer way: a copy, moved into place.

    ``edit`` maps the old source to the new one. Returns the old source.
    """
    live = root / "envs" / env / "env_source.py"
    old = live.read_text()
    new = edit(old)
    assert new != old, "the hotfix changed nothing"
    copy = live.with_name(".env_source.py.hotfix")
    copy.write_text(new)
    os.replace(copy, live)
    return old


def set_scale(value: float):
    """A ``hotfix`` edit that replaces the ``SCALE = ...`` line."""
    return lambda source: re.sub(r"(?m)^SCALE = .*$", f"SCALE = {value!r}", source)


def status_json(root: Path, *extra: str) -> dict:
    """``rootstock status --json`` as a dict."""
    return json.loads(run_rootstock("status", "--json", "--root", root, *extra, timeout=60).stdout)


def cells(root: Path, *extra: str) -> dict[tuple[str, str], dict[str, dict]]:
    """``(env, checkpoint) -> {cluster: state cell}`` from ``status --json``."""
    return {
        (env["name"], row["id"]): row["states"]
        for env in status_json(root, *extra)["envs"]
        for row in env["checkpoints"]
    }


def cell(root: Path, env: str, checkpoint: str, cluster: str = "testbox") -> dict:
    """One state cell of ``status --json``."""
    return cells(root)[(env, checkpoint)][cluster]


def smoke_json(root: Path, *extra: str, timeout: float = 300) -> tuple[int, dict]:
    """``smoke-test --json --device cpu``: (exit code, summary)."""
    proc = run_rootstock(
        "smoke-test", "--json", "--device", "cpu", "--root", root, *extra,
        check=False, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def manifest_record(root: Path, env: str, checkpoint: str, cluster: str = "testbox") -> dict:
    """The stored CPU verification record of ``checkpoint``."""
    data = json.loads((root / "manifest.json").read_text())
    return data["envs"][env]["checkpoints"][checkpoint]["verifications"][cluster]["cpu"]


def emt_reference_energy_per_atom(scale: float = 1.0) -> float:
    """In-process EMT energy per atom on the built-in reference structure."""
    from ase import Atoms
    from ase.calculators.emt import EMT

    from rootstock.ops.verify import default_reference

    spec = default_reference()
    atoms = Atoms(spec["symbols"], positions=spec["positions"], cell=spec["cell"], pbc=True)
    atoms.calc = EMT()
    return scale * atoms.get_potential_energy() / len(atoms)


class WeightsServer:
    """A loopback HTTP server handing out ``{"scale": ...}``; counts its requests."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests.append(self.path)
                body = json.dumps({"scale": server.scale}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/weights.json"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.running = True

    def stop(self) -> None:
        """Stop serving and close the port (idempotent)."""
        if self.running:
            self.running = False
            self.httpd.shutdown()
            self.httpd.server_close()
            self.thread.join(timeout=10)


def worker_pids(root: Path) -> list[int]:
    """Processes whose command line names ``root`` (workers of that install)."""
    found = []
    needle = str(root).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def reap_workers(root: Path, grace_s: float) -> list[int]:
    """Wait up to ``grace_s`` for ``root``'s workers to exit; SIGKILL and return the rest."""
    deadline = time.monotonic() + grace_s
    while (left := worker_pids(root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return left


@contextlib.contextmanager
def weights_server(scale: float) -> Iterator[WeightsServer]:
    """A running :class:`WeightsServer`, stopped on exit."""
    server = WeightsServer(scale)
    try:
        yield server
    finally:
        server.stop()
