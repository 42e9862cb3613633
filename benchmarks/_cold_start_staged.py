"""The staged side of ``benchmarks/cold_start.py``: workers started from a node-local stage.

Every measurement here starts against a fresh slowfs mount of the root (nothing of it
cached) and with a stage directory of its own standing for one node's local disk:

- **first staged**: the node has nothing yet; the worker's start stages the image
  (one sequential read of it from slowfs, checked against its sha256), then starts;
- **later staged**: the image is already on the node; only what every spawn reads
  from the shared root (env_source.py, the build record, the generation lock, the
  install's small files) reaches slowfs;
- **staging alone**: ``rootstock stage`` on an empty node, against the time to read
  the image once at the simulated bandwidth;
- **K nodes**: K processes, each with its own stage directory, start a worker at the
  same moment against one slowfs mount; the operations and bytes that reached it in
  total.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import median
from cold_start import counts, difference, first_energy, slowfs

_NODE_SCRIPT = """
import json, os, sys, time
sys.path.insert(0, {bench!r})
from cold_start import first_energy
go = {go!r}
while not os.path.exists(go):
    time.sleep(0.0005)
seconds, energy = first_energy({root!r}, {checkpoint!r}, stage={mode!r})
print(json.dumps({{"seconds": seconds, "energy": energy}}))
"""


@contextlib.contextmanager
def node(work: Path, name: str) -> Iterator[Path]:
    """A fresh stage directory (one node's local disk) for the block, cleaned after it."""
    from rootstock.runtime.stage_dir import STAGE_DIR_ENV, clean_stages

    base = work / "nodes" / name
    base.mkdir(parents=True)
    saved = os.environ.get(STAGE_DIR_ENV)
    os.environ[STAGE_DIR_ENV] = str(base)
    try:
        yield base
    finally:
        with contextlib.suppress(Exception):
            clean_stages()
        if saved is None:
            os.environ.pop(STAGE_DIR_ENV, None)
        else:
            os.environ[STAGE_DIR_ENV] = saved
        shutil.rmtree(base, ignore_errors=True)


def image_size(root: Path, env: str) -> int:
    from rootstock.install.layout import InstallLayout
    from rootstock.runtime.stage import build_image

    image = build_image(InstallLayout(root, root), env)
    if image is None:
        raise RuntimeError(f"the {env} build in {root} has no image: rebuild it with --image")
    return image.size


def measure_staged(
    root: Path, checkpoint: str, env: str, work: Path, args: Any, warm_s: float
) -> dict[str, Any]:
    """First and later staged starts (both modes), staging alone, and K nodes."""
    size = image_size(root, env)
    read_once_s = size / (args.read_mbps * 1e6)
    out: dict[str, Any] = {"image_bytes": size, "read_image_once_s": read_once_s}
    for mode in args.modes:
        first, later, first_served, later_served = [], [], {}, {}
        for run in range(args.runs):
            print(f"{checkpoint}: staged ({mode}) start {run + 1}/{args.runs} ...", file=sys.stderr)
            # One path for the root on both mounts, as on a cluster: a stage belongs
            # to the root it was staged from.
            shared = work / f"sf-{checkpoint}-{mode}-{run}"
            with node(work, f"{checkpoint}-{mode}-{run}"):
                with slowfs(root, shared, args.latency_ms, args.read_mbps) as m:
                    before = counts(m)
                    first.append(first_energy(m, checkpoint, stage=mode))
                    first_served = difference(counts(m), before)
                # The next worker on this node, against a cold shared filesystem.
                with slowfs(root, shared, args.latency_ms, args.read_mbps) as m:
                    before = counts(m)
                    later.append(first_energy(m, checkpoint, stage=mode))
                    later_served = difference(counts(m), before)
        out[mode] = {
            "first_s": median([s for s, _ in first]),
            "later_s": median([s for s, _ in later]),
            "first_served": first_served,
            "later_served": later_served,
            "energies": sorted({round(e, 10) for _, e in first + later}),
        }
    out["targets"] = {
        "first_s": (read_once_s + warm_s) * 1.2,
        "later_s": 1.5 * warm_s,
        "later_metadata_ops": 50,
        "stage_s": 1.2 * read_once_s,
    }
    out["stage_alone_s"] = stage_alone(root, env, work, args)
    if args.nodes:
        out["nodes"] = many_nodes(root, checkpoint, work, args, size)
    return out


def stage_alone(root: Path, env: str, work: Path, args: Any) -> float:
    """Seconds ``rootstock stage`` takes on an empty node (mount mode, from slowfs)."""
    from rootstock.install.layout import InstallLayout
    from rootstock.ops.stage import stage_envs

    with (
        node(work, f"stage-{env}"),
        slowfs(root, work / f"sf-stage-{env}", args.latency_ms, args.read_mbps) as m,
    ):
        start = time.perf_counter()
        (outcome,) = stage_envs(InstallLayout(m, m), [env], "mount")
        elapsed = time.perf_counter() - start
    if outcome.status != "staged":
        raise RuntimeError(f"staging {env} failed: {outcome.message}")
    return elapsed


def many_nodes(root: Path, checkpoint: str, work: Path, args: Any, size: int) -> dict[str, Any]:
    """K processes, each a node with its own stage directory, start at the same moment."""
    from rootstock.runtime.stage_dir import STAGE_DIR_ENV

    k = args.nodes
    print(f"{checkpoint}: {k} nodes starting at once ...", file=sys.stderr)
    go = work / f"go-{checkpoint}"
    bench = str(Path(__file__).resolve().parent)
    with contextlib.ExitStack() as nodes:
        bases = [nodes.enter_context(node(work, f"{checkpoint}-k{i}")) for i in range(k)]
        with slowfs(root, work / f"sf-{checkpoint}-k", args.latency_ms, args.read_mbps) as m:
            before = counts(m)
            script = _NODE_SCRIPT.format(
                bench=bench, go=str(go), root=str(m), checkpoint=checkpoint, mode="auto"
            )
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", script],
                    env={**os.environ, STAGE_DIR_ENV: str(base)},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for base in bases
            ]
            time.sleep(1.0)  # every node's Python up and polling
            go.touch()
            results = []
            for proc in procs:
                out, err = proc.communicate(timeout=3600)
                if proc.returncode != 0:
                    raise RuntimeError(f"a node failed:\n{err[-3000:]}")
                results.append(json.loads(out.strip().splitlines()[-1]))
            served = difference(counts(m), before)
    return {
        "k": k,
        "first_energy_s": [r["seconds"] for r in results],
        "energies": sorted({round(r["energy"], 10) for r in results}),
        "served": served,
        "bytes_per_image": served["bytes_read"] / size,
        "targets": {"images": 1.05 * k, "metadata_ops": 50 * k},
    }


def report_staged(model: str, r: dict[str, Any], unstaged_s: float, warm_s: float) -> None:
    from _common import print_table

    t = r["targets"]
    rows = [("unstaged, cold slowfs (today)", f"{unstaged_s:.2f}", "", "", "")]
    for mode in ("mount", "copy"):
        if mode not in r:
            continue
        s = r[mode]
        rows.append(
            (
                f"{mode}: first worker on the node",
                f"{s['first_s']:.2f}",
                f"<= {t['first_s']:.2f}",
                str(s["first_served"]["metadata_ops"]),
                f"{s['first_served']['bytes_read'] / 1e6:.1f}",
            )
        )
        rows.append(
            (
                f"{mode}: later worker (image on the node)",
                f"{s['later_s']:.2f}",
                f"<= {t['later_s']:.2f}",
                f"{s['later_served']['metadata_ops']} (<= {t['later_metadata_ops']})",
                f"{s['later_served']['bytes_read'] / 1e6:.1f}",
            )
        )
    rows.append(
        (
            "rootstock stage (mount), empty node",
            f"{r['stage_alone_s']:.2f}",
            f"<= {t['stage_s']:.2f}",
            "",
            f"{r['image_bytes'] / 1e6:.1f} (image)",
        )
    )
    header = ("", "seconds", "target", "metadata ops", "MB from slowfs")
    print_table(f"{model}: staged starts (warm local first energy {warm_s:.2f} s)", rows, header)
    for mode in ("mount", "copy"):
        if mode in r and len(r[mode]["energies"]) != 1:
            print(f"  WARNING: {mode}: the energies differ between starts")
        if mode in r:
            print(f"  {mode}, later worker, operations by kind: {r[mode]['later_served']['ops']}")
    n = r.get("nodes")
    if n:
        times = ", ".join(f"{s:.2f}" for s in n["first_energy_s"])
        print(
            f"  {n['k']} nodes at once: first energy per node {times} s; slowfs served "
            f"{n['served']['metadata_ops']} metadata operations (target <= "
            f"{n['targets']['metadata_ops']}) and {n['served']['bytes_read'] / 1e6:.1f} MB "
            f"= {n['bytes_per_image']:.2f} images (target <= {n['targets']['images']:.1f})"
        )
