"""``benchmarks/throughput.py``'s chunk-size section: the worker's peak memory per
chunk size, fixed counts beside ``batch_size="auto"``.

Each chunk size runs in a worker of its own, so one size's peak cannot hide
another's. The peak is the worker's resident high-water mark (VmHWM) over the
batch, reset after its warm-up call through ``/proc/<pid>/clear_refs`` (a process
may reset its own user's processes' marks), so the model's load does not count;
where the reset is refused the peak includes the load and says so. An ``"auto"``
worker resets its own mark before each sub-batch it measures, so at the end VmHWM
holds only the last one's: the worker's RSS is therefore also sampled every
millisecond during the batch, and the peak is the larger of the two. For
``"auto"`` the worker's own memory report gives the budget and each sub-batch's
measured peak. Reported, never asserted.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from _common import print_table

MB = 1e6


def _status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class RssSampler:
    """The largest VmRSS of ``pid`` seen while the ``with`` block runs, in KiB."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_kib = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._page_kib = os.sysconf("SC_PAGE_SIZE") // 1024

    def _sample(self) -> None:
        path = Path(f"/proc/{self.pid}/statm")
        while not self._stop.wait(0.001):
            try:
                resident = int(path.read_text().split()[1]) * self._page_kib
            except (OSError, ValueError, IndexError):
                return
            self.peak_kib = max(self.peak_kib, resident)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _reset_peak(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def one_size(
    root: Path, checkpoint: str, images: list[Any], size: Any, max_memory: Any, setup: dict
) -> dict[str, Any]:
    """One chunk size in a fresh worker: structures/s, peak RSS, and auto's report."""
    from rootstock import RootstockCalculator

    with RootstockCalculator(
        checkpoint, root=root, device="cpu", shared=False, pool=False,
        setup_kwargs=setup, batch_size=size, max_memory=max_memory,
    ) as calc:  # fmt: skip
        warm = images[0].copy()
        warm.calc = calc
        warm.get_potential_energy()
        pid = calc.worker_pid
        if pid is None:
            raise RuntimeError(f"{checkpoint}'s worker is not running after its first energy")
        reset = _reset_peak(pid)
        idle = _status_kib(pid, "VmRSS")
        with RssSampler(pid) as sampled:
            start = time.perf_counter()
            calc.calculate_batch(images)
            seconds = time.perf_counter() - start
        marked = _status_kib(pid, "VmHWM")
        peak = None if marked is None else max(marked, sampled.peak_kib)
        report = calc.memory_report
    row: dict[str, Any] = {
        "batch_size": size,
        "max_memory": max_memory,
        "per_s": len(images) / seconds,
        "peak_rss_mb": None if peak is None else peak * 1024 / MB,
        "growth_mb": None if peak is None or idle is None else (peak - idle) * 1024 / MB,
        "peak_reset": reset,
    }
    if report is not None:
        runs = [r for r in report["batches"] if r["peak"] is not None]
        row["budget_mb"] = None if report["budget"] is None else report["budget"] / MB
        row["largest_sub_batch"] = max((r["structures"] for r in report["batches"]), default=0)
        row["largest_sub_batch_peak_mb"] = max((r["peak"] for r in runs), default=0) / MB
        row["halvings"] = report["halvings"]
    return row


def chunk_memory(
    root: Path, checkpoint: str, images: list[Any], sizes: list[tuple[Any, Any]], setup: dict
) -> dict[str, Any]:
    """Every ``(batch_size, max_memory)`` of ``sizes`` on ``checkpoint``."""
    rows = [one_size(root, checkpoint, images, s, m, setup) for s, m in sizes]
    return {"checkpoint": checkpoint, "structures": len(images), "setup": setup, "rows": rows}


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def report_chunk_memory(section: dict[str, Any]) -> None:
    """One table per model: the peak per chunk size, and whether auto kept its budget."""
    if "error" in section:
        print(f"\nchunk memory: not measured: {section['error']}")
        return
    rows = []
    for row in section["rows"]:
        size = str(row["batch_size"])
        if row["max_memory"] is not None:
            size += f", max_memory={row['max_memory']}"
        within = ""
        if "budget_mb" in row and row["budget_mb"] is not None:
            kept = row["largest_sub_batch_peak_mb"] <= row["budget_mb"]
            within = (
                f"budget {_mb(row['budget_mb'])} MB, largest call {row['largest_sub_batch']} "
                f"structures at {row['largest_sub_batch_peak_mb']:.0f} MB: "
                f"{'within' if kept else 'OVER'}; halvings {row['halvings']}"
            )
        rows.append(
            (
                size,
                f"{row['per_s']:.1f}",
                _mb(row["peak_rss_mb"]) + ("" if row["peak_reset"] else " (with load)"),
                _mb(row["growth_mb"]),
                within,
            )
        )
    print_table(
        f"chunk sizes, {section['checkpoint']} ({section['structures']} structures, "
        f"setup {section['setup'] or '{}'}): the worker's peak RSS over the batch",
        rows,
        header=("batch_size", "structures/s", "peak RSS MB", "growth MB", "auto"),
    )
