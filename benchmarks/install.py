"""Benchmark: `rootstock install environments/emt.py` against a bare uv build.

Both sides use the same warm uv cache and the same interpreter, measured
alternately in one run. The bare side is `uv venv` + `uv pip install
--compile-bytecode` of the env's own dependencies, so the rootstock side builds without
an image (`--no-image`); one more install packs it, on a row of its own. Target:
rootstock <= 1.3x.

    python benchmarks/install.py [--quick] [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, run, timed

REPO = Path(__file__).resolve().parent.parent
ENV_FILE = REPO / "environments" / "emt.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one repetition (CI)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    repeat = 1 if args.quick else args.repeat

    from rootstock.install.envfile import read_env_file
    from rootstock.install.uv import uv_binary

    deps = read_env_file(ENV_FILE).dependencies
    uv = uv_binary()
    work = Path(tempfile.mkdtemp(prefix="rootstock-bench-install-"))
    cache = work / "uv-cache"
    cache.mkdir()
    env = {**os.environ, "ROOTSTOCK_CONFIG": str(work / "config.toml"), "UV_CACHE_DIR": str(cache)}
    rootstock = [sys.executable, "-m", "rootstock.cli.main"]
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

    def fresh_root(tag: str) -> Path:
        root = work / f"root-{tag}"
        run([*rootstock, "init", "--root", root, "--cluster", "bench", "--yes"], env=env)
        (root / ".uv-cache").symlink_to(cache)
        return root

    def rootstock_install(tag: str, image: bool = False) -> None:
        # Like for like with bare uv, without the image; the image's cost on its own row.
        root = fresh_root(tag)
        flag = "--image" if image else "--no-image"
        run([*rootstock, "install", ENV_FILE, "--root", root, "--python", python, flag], env=env)

    def bare_uv(tag: str) -> None:
        venv = work / f"bare-{tag}"
        run([uv, "venv", "--quiet", "--python", python, venv], env=env)
        run(
            [
                uv,
                "pip",
                "install",
                "--quiet",
                "--python",
                venv / "bin" / "python",
                "--compile-bytecode",
                *deps,
            ],
            env=env,
        )

    try:
        rootstock_install("warmup")  # fills the shared uv cache
        bare_uv("warmup")
        ours, bare = [], []
        for i in range(repeat):
            ours.append(timed(lambda i=i: rootstock_install(str(i))))
            bare.append(timed(lambda i=i: bare_uv(str(i))))
        ratio = median(ours) / median(bare)
        with_image = timed(lambda: rootstock_install("image", image=True))
        print_table(
            f"install benchmark (median of {repeat}, warm uv cache, {python})",
            [
                ("rootstock install emt.py --no-image", f"{median(ours):.2f} s", "", ""),
                ("  the same, packing its image (--image)", f"{with_image:.2f} s", "", ""),
                ("uv venv + uv pip install --compile-bytecode", f"{median(bare):.2f} s", "", ""),
                ("ratio", f"{ratio:.2f}x", "<= 1.3x", "yes" if ratio <= 1.3 else "no"),
            ],
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
