"""A read-only FUSE view of a directory that is slow on purpose, like a busy shared filesystem.

Run by ``scripts/dev/slowfs-up`` (and stopped by ``scripts/dev/slowfs-down``); see
``docs/cold-start.md``. Every metadata operation (getattr, the kernel's lookups included,
readlink, opendir, readdir, open, access, statfs) waits ``--latency-ms`` before it is
answered, and the reads of each open file are paced to ``--read-mbps``. The kernel
caches nothing: entry, attribute and negative timeouts are 0 and files are opened for
direct I/O, so every run is a cold run. Operations run on several threads at once, as
a parallel filesystem serves several clients at once.

Counts of operations by kind and of bytes read are served, as JSON, by the control file
``MOUNT/.slowfs-stats`` (not listed, neither counted nor delayed); they only grow, so a
benchmark reads them before and after and takes the difference.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import threading
import time
from collections import Counter
from typing import Any

import mfusepy

STATS_NAME = ".slowfs-stats"
STATS_PATH = "/" + STATS_NAME
#: File handles below this are real descriptors; the control file's are above it.
_STATS_FH = 1 << 40


class SlowFS(mfusepy.Operations):
    use_ns = True

    def __init__(self, source: str, latency_s: float, read_bps: float) -> None:
        self.source = os.path.realpath(source)
        self.latency_s = latency_s
        self.read_bps = read_bps
        self._lock = threading.Lock()
        self._ops: Counter[str] = Counter()
        self._bytes = 0
        self._snapshots: dict[int, bytes] = {}
        self._next_fh = _STATS_FH

    # -- bookkeeping --------------------------------------------------------------
    def _metadata(self, kind: str) -> None:
        with self._lock:
            self._ops[kind] += 1
        if self.latency_s:
            time.sleep(self.latency_s)

    def _real(self, path: str) -> str:
        return self.source + path if path != "/" else self.source

    def stats(self) -> dict[str, Any]:
        with self._lock:
            ops = dict(sorted(self._ops.items()))
            read = self._bytes
        return {
            "pid": os.getpid(),
            "source": self.source,
            "latency_ms": self.latency_s * 1000,
            "read_mbps": self.read_bps / 1e6,
            "ops": ops,
            "metadata_ops": sum(n for kind, n in ops.items() if kind != "read"),
            "bytes_read": read,
        }

    # -- the filesystem -----------------------------------------------------------
    def init_with_config(self, conn_info: Any, config_3: Any) -> None:
        if config_3 is not None:  # libfuse 3: nothing is cached by the kernel
            config_3.entry_timeout = 0.0
            config_3.attr_timeout = 0.0
            config_3.negative_timeout = 0.0
            config_3.direct_io = 1

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        if path == STATS_PATH:
            now = time.time_ns()
            size = len(json.dumps(self.stats())) + 4096
            return {
                "st_mode": 0o100444,
                "st_nlink": 1,
                "st_size": size,
                "st_uid": os.getuid(),
                "st_gid": os.getgid(),
                "st_atime": now,
                "st_mtime": now,
                "st_ctime": now,
            }
        self._metadata("getattr")
        try:
            st = os.lstat(self._real(path))
        except OSError as exc:
            raise mfusepy.FuseOSError(exc.errno) from None
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino")
        out: dict[str, Any] = {key: getattr(st, key) for key in keys}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return out

    def readlink(self, path: str) -> str:
        self._metadata("readlink")
        try:
            return os.readlink(self._real(path))
        except OSError as exc:
            raise mfusepy.FuseOSError(exc.errno) from None

    def access(self, path: str, amode: int) -> int:
        self._metadata("access")
        if amode & os.W_OK:
            raise mfusepy.FuseOSError(errno.EROFS)
        if not os.access(self._real(path), amode):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def opendir(self, path: str) -> int:
        self._metadata("opendir")
        return 0

    def readdir(self, path: str, fh: int) -> list[str]:
        self._metadata("readdir")
        try:
            return [".", "..", *os.listdir(self._real(path))]
        except OSError as exc:
            raise mfusepy.FuseOSError(exc.errno) from None

    def statfs(self, path: str) -> dict[str, int]:
        self._metadata("statfs")
        st = os.statvfs(self.source)
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree")
        return {key: getattr(st, key) for key in keys} | {"f_namemax": st.f_namemax}

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise mfusepy.FuseOSError(errno.EROFS)
        if path == STATS_PATH:
            with self._lock:
                self._next_fh += 1
                fh = self._next_fh
            self._snapshots[fh] = (json.dumps(self.stats(), indent=1) + "\n").encode()
            return fh
        self._metadata("open")
        try:
            return os.open(self._real(path), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise mfusepy.FuseOSError(exc.errno) from None

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        if fh > _STATS_FH:
            return self._snapshots.get(fh, b"")[offset : offset + size]
        started = time.monotonic()
        data = os.pread(fh, size, offset)
        with self._lock:
            self._ops["read"] += 1
            self._bytes += len(data)
        if self.read_bps:
            # This file's reads are paced: each takes at least its share of the bandwidth.
            left = len(data) / self.read_bps - (time.monotonic() - started)
            if left > 0:
                time.sleep(left)
        return data

    def release(self, path: str, fh: int) -> int:
        if fh > _STATS_FH:
            self._snapshots.pop(fh, None)
        else:
            os.close(fh)
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slowfs", description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("mount")
    parser.add_argument("--latency-ms", type=float, default=1.0)
    parser.add_argument("--read-mbps", type=float, default=50.0)
    args = parser.parse_args(argv)
    if args.latency_ms < 0 or args.read_mbps < 0:
        parser.error("--latency-ms and --read-mbps must not be negative (0 turns one off)")
    if not os.path.isdir(args.source):
        parser.error(f"the source {args.source} is not a directory")
    ops = SlowFS(args.source, args.latency_ms / 1000, args.read_mbps * 1e6)
    options: dict[str, Any] = {"ro": True, "fsname": f"slowfs:{ops.source}", "subtype": "slowfs"}
    if os.getuid() == 0:
        options["allow_other"] = True  # other users' tests (setpriv) read it too
    mfusepy.FUSE(ops, args.mount, foreground=True, **options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
