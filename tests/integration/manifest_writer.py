"""A manifest writer process for the concurrency and crash-safety tests.

    python manifest_writer.py ROOT PREFIX COUNT [--no-fcntl] [--go FILE]

Writes COUNT stamps (0: until killed) through the public manifest API, alternating
``record_fetch`` and ``record_verification``, and after each write *returns* prints
``done <checkpoint-id>`` and flushes: a line on stdout is a promise that the stamp is
on disk. ``--no-fcntl`` makes ``fcntl.lockf`` refuse with ENOLCK, as Lustre mounted
without ``flock`` does, so the ``mkdir`` fallback lock is used. ``--go FILE`` waits
for FILE to exist before starting, so that many writers start together. Each write
also bumps a counter with a deliberately slow read-modify-write, which loses counts
unless writers are serialised.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import sys
import time
from pathlib import Path

from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import record_fetch, record_verification, update_manifest

ENV = "stamps"


def _refuse_lockf(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOLCK, "No locks available")


def _bump_counter(data: dict) -> None:
    seen = data.get("test_counter", 0)
    time.sleep(0.002)  # widen the window a lost update would need
    data["test_counter"] = seen + 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("prefix")
    parser.add_argument("count", type=int)
    parser.add_argument("--no-fcntl", action="store_true")
    parser.add_argument("--go", type=Path)
    args = parser.parse_args()
    if args.no_fcntl:
        fcntl.lockf = _refuse_lockf
    layout = InstallLayout(args.root, args.root)
    if args.go:
        deadline = time.monotonic() + 30
        while not args.go.exists():
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.005)
    i = 0
    while args.count == 0 or i < args.count:
        checkpoint = f"{args.prefix}-{i}"
        if i % 2:
            result = {
                "passed": True,
                "device": "cpu",
                "fingerprint": {"energy_per_atom": -3.5, "force_norm": 1.0, "stress": None},
            }
            record_verification(layout, ENV, checkpoint, "testbox", result)
        else:
            record_fetch(layout, ENV, checkpoint)
        print(f"done {checkpoint}", flush=True)
        update_manifest(layout, _bump_counter)
        i += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
