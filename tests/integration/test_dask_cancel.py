"""Closing the Dask client or its cluster while ``rootstock.evaluate`` runs on it.

The run must end in an :class:`~rootstock.errors.EngineError` that says the client
or cluster was closed during the run, never in Dask's own ``ClosedClientError`` (or
``CancelledError``) from rootstock's cleanup of the chunks in flight.

Not timing-sensitive: the close happens only once a first result is in this
thread's hands, and the input holds far more work than the one Dask worker can
finish before the close lands (every calculation sleeps), so the run is always
still going when it does; a slow machine only makes that margin larger.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import distributed
import pytest

import rootstock
from rootstock.errors import EngineError
from tests.integration.killing import is_running
from tests.integration.test_scale_out_dask import cu_cells, setups

pytestmark = pytest.mark.usefixtures("runtime_isolation")
BUILD_AND_RUN_S = 900  # the first test of a session also waits for the root's uv build
START_S = 120
IMAGES = 200
DELAY_S = 0.1  # per calculation: 200 x 0.1 s is far more than a close takes


@pytest.fixture
def local_cluster() -> Any:
    """One single-thread worker process, on 127.0.0.1; closed in teardown."""
    cluster = distributed.LocalCluster(
        n_workers=1,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",
    )
    client = distributed.Client(cluster)
    try:
        client.wait_for_workers(1, timeout=60)
        yield client, cluster
    finally:
        with contextlib.suppress(Exception):
            client.close(timeout=30)
        with contextlib.suppress(Exception):
            cluster.close(timeout=30)


def _wait_gone(pids: set[int], timeout: float = 30) -> set[int]:
    deadline = time.monotonic() + timeout
    alive = {p for p in pids if is_running(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = {p for p in alive if is_running(p)}
    return alive


@pytest.mark.timeout(BUILD_AND_RUN_S)
@pytest.mark.parametrize("closed", ["client", "cluster"])
def test_closing_dask_mid_run_is_an_engine_error(
    closed: str, local_cluster: Any, fake_built_root: Path, tmp_path: Path
) -> None:
    client, cluster = local_cluster
    count = tmp_path / "count.jsonl"
    stream = rootstock.evaluate_iter(
        cu_cells(IMAGES),
        checkpoint="count-emt",
        root=fake_built_root,
        executor=client,
        batch_size=2,
        start_timeout=START_S,
        setup_kwargs={"count_file": str(count), "delay": DELAY_S},
    )
    got = [next(stream)]  # the first result has arrived: the run is under way
    target = client if closed == "client" else cluster
    closer = threading.Thread(target=lambda: target.close(timeout=60), daemon=True)
    closer.start()
    with pytest.raises(EngineError) as caught:
        got.extend(stream)
    closer.join(timeout=90)
    assert not closer.is_alive(), f"closing the {closed} did not finish"
    assert len(got) < IMAGES
    assert f"the Dask {closed} was closed during the run" in str(caught.value)
    # No Rootstock worker outlives its closed cluster (teardown closes the cluster
    # in the client case).
    if closed == "cluster":
        assert _wait_gone({load["pid"] for load in setups(count)}) == set()


@pytest.mark.timeout(BUILD_AND_RUN_S)
def test_closing_the_client_under_evaluate_is_an_engine_error(
    local_cluster: Any, fake_built_root: Path, tmp_path: Path
) -> None:
    """The list-returning ``evaluate``: the close comes from another thread once the
    model has loaded and a first calculation has been traced."""
    client, _ = local_cluster
    count, trace = tmp_path / "count.jsonl", tmp_path / "trace.jsonl"

    def close_once_running() -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and len(_lines(trace)) < 2:
            time.sleep(0.05)
        client.close(timeout=60)

    closer = threading.Thread(target=close_once_running, daemon=True)
    closer.start()
    with pytest.raises(EngineError, match=r"Dask client was closed during the run"):
        rootstock.evaluate(
            cu_cells(IMAGES),
            checkpoint="count-emt",
            root=fake_built_root,
            executor=client,
            batch_size=2,
            start_timeout=START_S,
            setup_kwargs={"count_file": str(count), "delay": DELAY_S, "trace_file": str(trace)},
        )
    closer.join(timeout=90)
    assert not closer.is_alive()


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []
