"""Benchmark: a no-op `rootstock sync SOURCE_DIR` against `rootstock status` on the same
install.

The install is synthetic: 7 envs x 25 checkpoints on one cluster, every checkpoint
fetched and verified on the CPU against the current build (env sources, build
metadata and a full manifest written directly, nothing built), and SOURCE_DIR holds
the very env files the envs were "built" from. So the sync has nothing to do: it
must read the install, parse and lint SOURCE, plan, and exit 0, with no uv and no
worker. Each command runs as a whole process, alternately, with this interpreter:

* `sync SOURCE_DIR --device cpu --no-push` <= 2x `status --json` (the target);
* `status` (the rich table) is timed too, for reference.

    python benchmarks/sync_noop.py [--quick] [--repeat N]

Reports a table; never asserts (these machines are too noisy for that).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, run, timed, write_built_env

N_ENVS, N_CHECKPOINTS, CLUSTER = 7, 25, "bench"
STAMP = "2025-03-01T09:00:00+00:00"

ENV_SOURCE = '''\
"""Synthetic benchmark env {name}."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy>=1.24"]
# ///

CHECKPOINTS = {checkpoints}


def setup(checkpoint, device="cuda", **kw):
    """Plain EMT whatever the id (benchmarks only)."""
    from ase.calculators.emt import EMT

    return EMT()
'''


def verified(build: dict) -> dict:
    """A passing CPU verification against ``build`` (docs/manifest.md)."""
    fingerprint = {
        "energy_per_atom": -3.9,
        "force_norm": 1.2345,
        "stress": [0.1, 0.1, 0.1, 0.0, 0.0, 0.0],
        "natoms": 8,
        "device_kind": "cpu",
        "torch": None,
        "env_versions": {"ase": "3.23.0"},
    }
    return {
        "state": "verified",
        "at": STAMP,
        "device": "cpu",
        "device_kind": "cpu",
        "message": None,
        "fingerprint": fingerprint,
        "reference": {"fingerprint": fingerprint, "at": STAMP, "build": build},
        "drift": None,
        "build": build,
    }


def synthetic_install(root: Path, source: Path) -> None:
    """7 envs x 25 checkpoints, converged: sources, metadata, manifest and SOURCE_DIR."""
    from rootstock import __version__
    from rootstock.install.layout import InstallLayout, write_layout
    from rootstock.install.manifest import load_manifest, new_manifest

    root.mkdir(parents=True)
    source.mkdir(parents=True)
    write_layout(root, None)
    layout = InstallLayout(root, root)
    for directory in (
        layout.home_dir,
        layout.cache_dir,
        layout.envs_dir,
        layout.environments_dir,
        layout.locks_dir,
    ):
        directory.mkdir(parents=True, exist_ok=True)
    manifest = new_manifest([CLUSTER])
    for i in range(N_ENVS):
        name = f"env{i:02d}"
        ids = [f"model{i:02d}-ck{j:02d}" for j in range(N_CHECKPOINTS)]
        text = ENV_SOURCE.format(
            name=name, checkpoints="{" + ", ".join(f'"{c}": "{c}"' for c in ids) + "}"
        )
        (source / f"{name}.py").write_text(text)
        versions = {"python": "3.11.9", "ase": "3.23.0", "rootstock": __version__}
        build = write_built_env(root, name, i, text, STAMP, versions)
        manifest["envs"][name] = {
            **build,
            "python": "3.11.9",
            "python_path": sys.executable,
            "torch": None,
            "rootstock": __version__,
            "checkpoints": {
                checkpoint: {
                    "fetched_at": STAMP,
                    "verifications": {CLUSTER: {"cpu": verified(build)}},
                }
                for checkpoint in ids
            },
        }
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":")) + "\n"
    (root / "manifest.json").write_text(text)
    load_manifest(layout)  # the synthetic file must be one we accept


def check_noop(argv: list, env: dict) -> None:
    """Make sure the timed sync really plans nothing and reads the whole install."""
    proc = subprocess.run(
        [*map(str, argv), "--json"], env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the no-op sync failed ({proc.returncode}):\n{proc.stderr}")
    doc = json.loads(proc.stdout)
    if doc["plan"]["items"] or doc["plan"]["notes"] or len(doc["source"]["files"]) != N_ENVS:
        raise RuntimeError(f"the synthetic install is not converged: {doc['plan']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (CI)")
    parser.add_argument("--repeat", type=int, default=9, help="runs of each command")
    args = parser.parse_args()
    repeat = 3 if args.quick else args.repeat

    work = Path(tempfile.mkdtemp(prefix="rootstock-bench-sync-"))
    # Cached bytecode, as an installed rootstock has, in a private prefix.
    env = {
        **os.environ,
        "ROOTSTOCK_CONFIG": str(work / "config.toml"),
        "PYTHONPYCACHEPREFIX": str(work / "pycache"),
    }
    for name in ("ROOTSTOCK_CLUSTERS_FILE", "ROOTSTOCK_ROOT", "PYTHONDONTWRITEBYTECODE"):
        env.pop(name, None)
    rootstock = [sys.executable, "-m", "rootstock.cli.main"]
    try:
        root, source = work / "root", work / "source"
        synthetic_install(root, source)
        commands = {
            "sync": [*rootstock, "sync", source, "--root", root, "--device", "cpu", "--no-push"],
            "status": [*rootstock, "status", "--json", "--root", root],
            "table": [*rootstock, "status", "--root", root],
        }
        for _ in range(2):  # write the bytecode, then warm the page cache
            for argv in commands.values():
                run(argv, env=env)
        check_noop(commands["sync"], env)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(repeat):
            for name, argv in commands.items():
                times[name].append(timed(lambda argv=argv: run(argv, env=env)))
        t = {name: median(values) for name, values in times.items()}
        ratio = t["sync"] / t["status"]
        rows = [
            (f"status --json ({N_ENVS}x{N_CHECKPOINTS})", f"{t['status']:.3f} s", "", ""),
            ("status (table)", f"{t['table']:.3f} s", "", ""),
            ("sync SOURCE_DIR (no-op)", f"{t['sync']:.3f} s", "", ""),
            ("  sync / status --json", f"{ratio:.2f}x", "<= 2x", "yes" if ratio <= 2 else "no"),
            ("  sync / status (table)", f"{t['sync'] / t['table']:.2f}x", "", ""),
        ]
        print_table(f"no-op sync benchmark (median of {repeat}, {sys.executable})", rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
