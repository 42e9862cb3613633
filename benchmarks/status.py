"""Benchmark: `rootstock status --json` and `rootstock --help` as whole processes,
and `smoke-test --jobs 2` against `--jobs 1`.

status and --help run against a synthetic install of 40 envs x 25 checkpoints
serving 3 clusters (env sources, build metadata and a full manifest written
directly, nothing built), measured alternately with their floors in one run, all
with this interpreter:

* `status --json` <= 2x `python -c "import ase"` (what any ASE user pays anyway);
* `--help` <= 1.2x `python -c pass` + 0.1 s (no rich, numpy or ase on that path).

The smoke-test part builds one real EMT-backed env with 10 checkpoint ids (warm
uv cache: about 10 s) and times `smoke-test --device cpu` with `--jobs 2` against
`--jobs 1`: target <= 0.7x. It needs uv's cache or the network; `--no-build`
skips it.

`--baseline REF` also times `status --json`, the `status` table and `--help` of
the commit REF (a git worktree of it, imported through PYTHONPATH) alternately
with this checkout's, on the same synthetic install, and reports this checkout's
time over REF's.

    python benchmarks/status.py [--quick] [--repeat N] [--no-build] [--uv-cache DIR]
                                [--baseline REF]

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

N_ENVS, N_CHECKPOINTS, CLUSTERS = 40, 25, ("alpha", "beta", "gamma")
N_VARIANTS = 4  # the last envs are gamma-only variants shadowing the first envs' ids
SMOKE_IDS = 10
COMPARED = {"status": "status --json", "table": "status (table)", "help": "--help"}
STAMP = "2025-03-01T09:00:00+00:00"

ENV_SOURCE = '''\
"""Synthetic benchmark env {name}."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy>=1.24"]
# ///

CHECKPOINTS = {checkpoints}
{clusters}
VERIFY_KWARGS = {{{first!r}: {{"task": "omat"}}}}


def setup(checkpoint, device="cuda", **kw):
    """Plain EMT whatever the id (benchmarks only)."""
    from ase.calculators.emt import EMT

    return EMT()
'''


def env_ids(index: int) -> list[str]:
    """Checkpoint ids of env ``index``; a variant redeclares its universal twin's ids."""
    owner = index - (N_ENVS - N_VARIANTS) if index >= N_ENVS - N_VARIANTS else index
    return [f"model{owner:02d}-ck{j:02d}" for j in range(N_CHECKPOINTS)]


def verification(state: str, kind: str, build: dict, energy: float) -> dict:
    """One verification record in the manifest's schema (docs/manifest.md)."""
    fingerprint = {
        "energy_per_atom": energy,
        "force_norm": 1.2345,
        "stress": [0.1, 0.1, 0.1, 0.0, 0.0, 0.0],
        "natoms": 8,
        "device_kind": kind,
        "torch": "2.4.0",
        "env_versions": {"ase": "3.23.0"},
    }
    reference = {"fingerprint": fingerprint, "at": STAMP, "build": build}
    return {
        "state": state,
        "at": STAMP,
        "device": "cuda:0" if kind == "gpu" else "cpu",
        "device_kind": kind,
        "message": None if state == "verified" else f"synthetic {state} result",
        "fingerprint": None if state == "failed" else fingerprint,
        "reference": reference,
        "drift": None,
        "build": build,
    }


def synthetic_install(root: Path) -> None:
    """40 envs x 25 checkpoints on 3 clusters: sources, metadata and manifest only."""
    from rootstock.install.layout import write_layout
    from rootstock.install.manifest import load_manifest, new_manifest

    root.mkdir(parents=True)
    write_layout(root, None)
    for sub in ("home", "cache", "envs", "environments", ".locks"):
        (root / sub).mkdir()
    manifest = new_manifest(CLUSTERS)
    states = ("verified", "verified", "verified", "failed", "drifted")
    for i in range(N_ENVS):
        name = f"env{i:02d}"
        ids = env_ids(i)
        variant = i >= N_ENVS - N_VARIANTS
        source = ENV_SOURCE.format(
            name=name,
            checkpoints="{" + ", ".join(f'"{c}": "{c}"' for c in ids) + "}",
            clusters='CLUSTERS = ["gamma"]\n' if variant else "",
            first=ids[0],
        )
        versions = {"python": "3.11.9", "torch": "2.4.0", "ase": "3.23.0"}
        build = write_built_env(root, name, i, source, STAMP, versions)
        checkpoints = {}
        for j, checkpoint in enumerate(ids):
            served = ("gamma",) if variant else CLUSTERS
            checkpoints[checkpoint] = {
                "fetched_at": STAMP,
                "verifications": {
                    cluster: {
                        kind: verification(states[(i + j + k) % len(states)], kind, build, -3.9)
                        for k, kind in enumerate(("gpu", "cpu"))
                    }
                    for cluster in served
                },
            }
        manifest["envs"][name] = {
            **build,
            "python": "3.11.9",
            "python_path": sys.executable,
            "torch": "2.4.0",
            "rootstock": "0.1.0",
            "checkpoints": checkpoints,
        }
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":")) + "\n"
    (root / "manifest.json").write_text(text)
    from rootstock.install.layout import InstallLayout

    load_manifest(InstallLayout(root, root))  # the synthetic file must be one we accept


def check_status(argv: list, env: dict) -> None:
    """Make sure the timed status really renders the whole synthetic grid."""
    proc = subprocess.run(
        list(map(str, argv)), env=env, capture_output=True, text=True, timeout=300, check=True
    )
    doc = json.loads(proc.stdout)
    cells = sum(len(row["states"]) for e in doc["envs"] for row in e["checkpoints"])
    # Universal ids on every cluster; on gamma a variant's cell replaces each one it shadows.
    expected = (N_ENVS - N_VARIANTS) * N_CHECKPOINTS * len(CLUSTERS)
    if len(doc["envs"]) != N_ENVS or cells != expected or doc["warnings"]:
        raise RuntimeError(
            f"status shows {len(doc['envs'])} envs and {cells} cells, "
            f"expected {N_ENVS} and {expected}: {doc['warnings']}"
        )


def smoke_env(directory: Path) -> Path:
    """A real, EMT-backed env file serving SMOKE_IDS checkpoints."""
    ids = ", ".join(f'"bench-emt-{i}": "{i}"' for i in range(SMOKE_IDS))
    path = directory / "bench-emt.py"
    path.write_text(
        ENV_SOURCE.format(
            name="bench-emt", checkpoints="{" + ids + "}", clusters="", first="bench-emt-0"
        ).replace('VERIFY_KWARGS = {"bench-emt-0": {"task": "omat"}}\n', "")
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (CI)")
    parser.add_argument("--repeat", type=int, default=9, help="runs of each process timing")
    parser.add_argument("--no-build", action="store_true", help="skip the smoke-test part")
    parser.add_argument(
        "--uv-cache",
        type=Path,
        default=Path(os.environ.get("UV_CACHE_DIR") or Path.home() / ".cache" / "uv"),
        help="uv cache for the EMT build (default: $UV_CACHE_DIR or ~/.cache/uv)",
    )
    parser.add_argument(
        "--baseline", metavar="REF", help="also time status and --help of this git commit"
    )
    args = parser.parse_args()
    repeat = 3 if args.quick else args.repeat
    smoke_repeat = 1 if args.quick else 2

    work = Path(tempfile.mkdtemp(prefix="rootstock-bench-status-"))
    # Every timed process (floors included) gets cached bytecode, as an installed
    # rootstock has: in a private prefix, so the checkout and venv stay untouched
    # even where PYTHONDONTWRITEBYTECODE is set.
    env = {
        **os.environ,
        "ROOTSTOCK_CONFIG": str(work / "config.toml"),
        "PYTHONPYCACHEPREFIX": str(work / "pycache"),
    }
    for name in ("ROOTSTOCK_CLUSTERS_FILE", "PYTHONDONTWRITEBYTECODE"):
        env.pop(name, None)
    python = sys.executable
    rootstock = [python, "-m", "rootstock.cli.main"]
    rows: list[tuple[str, str, str, str]] = []
    try:
        root = work / "synthetic"
        synthetic_install(root)
        commands = {
            "status": [*rootstock, "status", "--json", "--root", root],
            "help": [*rootstock, "--help"],
            "ase": [python, "-c", "import ase"],
            "pass": [python, "-c", "pass"],
        }
        envs = dict.fromkeys(commands, env)
        if args.baseline:
            # The table a person reads too: rich's rendering is most of it.
            commands["table"] = [*rootstock, "status", "--root", root]
            envs["table"] = env
            base_env = {**env, "PYTHONPATH": str(baseline_tree(work, args.baseline) / "src")}
            for name in COMPARED:
                commands[f"base-{name}"] = commands[name]
                envs[f"base-{name}"] = base_env
        for _ in range(2):  # write the bytecode, then warm the page cache
            for name, argv in commands.items():
                run(argv, env=envs[name])
        check_status(commands["status"], env)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(repeat):
            for name, argv in commands.items():
                times[name].append(timed(lambda argv=argv, e=envs[name]: run(argv, env=e)))
        t = {name: median(values) for name, values in times.items()}
        help_limit = 1.2 * t["pass"] + 0.1
        rows += [
            ('python -c "pass"', f"{t['pass']:.3f} s", "", ""),
            ('python -c "import ase"', f"{t['ase']:.3f} s", "", ""),
            (
                f"status --json ({N_ENVS}x{N_CHECKPOINTS}, {len(CLUSTERS)} clusters)",
                f"{t['status']:.3f} s = {t['status'] / t['ase']:.2f}x import ase",
                "<= 2x",
                "yes" if t["status"] <= 2 * t["ase"] else "no",
            ),
            (
                "rootstock --help",
                f"{t['help']:.3f} s",
                f"<= {help_limit:.3f} s",
                "yes" if t["help"] <= help_limit else "no",
            ),
        ]
        if args.baseline:
            for name in COMPARED:
                rows.append(
                    (
                        f"{COMPARED[name]}: this checkout / {args.baseline}",
                        f"{t[name]:.3f} s / {t['base-' + name]:.3f} s"
                        f" = {t[name] / t['base-' + name]:.2f}x",
                        "<= 1.05x",
                        "yes" if t[name] <= 1.05 * t["base-" + name] else "no",
                    )
                )
        if not args.no_build:
            rows += smoke_rows(work, env, rootstock, args.uv_cache, smoke_repeat)
        print_table(f"status benchmark (median of {repeat}, {python})", rows)
    finally:
        if args.baseline:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(work / "baseline")],
                capture_output=True,
            )
        shutil.rmtree(work, ignore_errors=True)


REPO = Path(__file__).resolve().parent.parent


def baseline_tree(work: Path, ref: str) -> Path:
    """A detached git worktree of ``ref`` (removed again when the run ends)."""
    tree = work / "baseline"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), ref],
        check=True,
        capture_output=True,
    )
    return tree


def smoke_rows(work: Path, env: dict, rootstock: list, uv_cache: Path, repeat: int) -> list:
    """Build the 10-checkpoint EMT env, fetch every id, time --jobs 1 and --jobs 2."""
    root = work / "emt-root"
    run([*rootstock, "init", "--root", root, "--cluster", "bench", "--yes"], env=env)
    uv_cache.mkdir(parents=True, exist_ok=True)
    (root / ".uv-cache").symlink_to(uv_cache)
    run([*rootstock, "install", smoke_env(work), "--root", root], env=env)
    for i in range(SMOKE_IDS):
        run([*rootstock, "add", f"bench-emt-{i}", "--no-verify", "--root", root], env=env)
    smoke = [*rootstock, "smoke-test", "--device", "cpu", "--root", root, "--jobs"]
    serial, parallel = [], []
    for _ in range(repeat):
        serial.append(timed(lambda: run([*smoke, "1"], env=env)))
        parallel.append(timed(lambda: run([*smoke, "2"], env=env)))
    ratio = median(parallel) / median(serial)
    return [
        (f"smoke-test {SMOKE_IDS} EMT ids --jobs 1", f"{median(serial):.2f} s", "", ""),
        (f"smoke-test {SMOKE_IDS} EMT ids --jobs 2", f"{median(parallel):.2f} s", "", ""),
        ("  --jobs 2 / --jobs 1", f"{ratio:.2f}x", "<= 0.7x", "yes" if ratio <= 0.7 else "no"),
    ]


if __name__ == "__main__":
    main()
