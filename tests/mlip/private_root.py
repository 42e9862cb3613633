"""A root of a test module's own, holding copies of family envs built in the shared root.

The family root (``family_root`` / ``mlip_root`` in tests/conftest.py) is built once per
run and used by every pytest process of the run at the same time, so no test may change
it: a hotfixed ``env_source.py`` there is what every other process's next worker loads
(a drift test's energy x 1.001 once failed the CHGNet integration tests running beside
it). A test that hotfixes a source, records checkpoints in the manifest or rebuilds an
env works on a root of its own, made by :func:`private_family_root`.

A copy costs no uv build: each env's generation directory is copied as it stands (an
env is relocatable: a relative ``envs/<name>`` link, no absolute path inside but the
system interpreter), and the manifest gets the build record that ``install`` wrote
for it, from the copied ``rootstock-env.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import record_env_build
from tests.conftest import make_root

#: The one part of a generation that is copied as hard links: its site-packages are
#: already hard links into uv's cache (how uv installs), and nothing rewrites an
#: installed file in place (Python writes bytecode to a new file and renames it; a
#: rebuild makes a new generation). Everything else (env_source.py, the build record,
#: the generation lock, bin/) is copied for real, so the copy's own files, and its
#: locks, are its own.
LINKED = "lib"


def private_family_root(
    family_root: Path, path: Path, names: Iterable[str], uv_cache: Path
) -> Path:
    """``rootstock init`` at ``path``, then the envs ``names`` of ``family_root`` copied in
    and recorded in its manifest as built (the same build ids: status says "built",
    not "stale"). The envs must be built in ``family_root`` already."""
    make_root(path, uv_cache)
    layout = InstallLayout(path, path)
    for name in names:
        generation = family_root / "envs" / os.readlink(family_root / "envs" / name)
        copy = path / "envs" / generation.name
        copy.mkdir()
        for part in sorted(generation.iterdir()):
            flags = "-al" if part.name == LINKED else "-a"
            subprocess.run(["cp", flags, str(part), str(copy)], check=True, timeout=600)
        shutil.copystat(generation, copy)
        (path / "envs" / name).symlink_to(generation.name)
        for suffix in (".py", ".py.lock"):
            registered = family_root / "environments" / f"{name}{suffix}"
            shutil.copy2(registered, path / "environments" / registered.name)
        record_env_build(layout, name, build_record(copy))
    return path


def build_record(generation: Path) -> dict[str, str | None]:
    """The manifest's build fields for a built generation, from its ``rootstock-env.json``
    (what ``rootstock install`` records)."""
    meta = json.loads((generation / "rootstock-env.json").read_text())
    versions = meta.get("versions") or {}
    return {
        "source_hash": meta["source_hash"],
        "lock_hash": meta.get("lock_hash"),
        "built_at": meta["built_at"],
        "build_id": meta["build_id"],
        "python": versions.get("python"),
        "python_path": (meta.get("interpreter") or {}).get("path"),
        "torch": versions.get("torch"),
        "rootstock": versions.get("rootstock"),
    }
