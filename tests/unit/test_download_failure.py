"""How a failed download's cause is told from the worker's output (no worker here:
the outputs are the last lines real libraries print; tests/integration/
test_add_failures.py makes each cause happen in a real worker)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rootstock.install.layout import InstallLayout
from rootstock.runtime.download_failure import download_failure


def failure(tmp_path: Path, output: str, exit_code: int | None = 1, timed_out: bool = False):
    layout = InstallLayout(tmp_path, tmp_path)
    return download_failure(
        layout,
        "mace",
        "mace-mp-0",
        output=output,
        exit_code=exit_code,
        timeout=60.0,
        timed_out=timed_out,
    )


@pytest.mark.parametrize(
    ("last_line", "cause"),
    [
        (
            "huggingface_hub.errors.GatedRepoError: 401 Client Error. Cannot access gated "
            "repo for url https://huggingface.co/org/model/resolve/main/model.pt.",
            "gated",
        ),
        (
            "requests.exceptions.HTTPError: 403 Client Error: Forbidden for url: "
            "https://huggingface.co/api/models/org/model",
            "gated",
        ),
        (
            "requests.exceptions.ConnectionError: HTTPSConnectionPool(host='huggingface.co', "
            "port=443): Max retries exceeded with url: /org/model (Caused by "
            "NameResolutionError: Failed to resolve 'huggingface.co' ([Errno -3] Temporary "
            "failure in name resolution))",
            "network",
        ),
        ("OSError: [Errno 28] No space left on device: '/cache/model.pt'", "disk-full"),
        ("ValueError: unknown model name 'mace-mp-0'", "error"),
    ],
)
def test_the_cause_is_told_from_the_traceback(tmp_path: Path, last_line: str, cause: str):
    output = f'Traceback (most recent call last):\n  File "x.py", line 1\n{last_line}\n'
    error = failure(tmp_path, output)
    assert error.cause == cause
    assert error.log_path is not None and error.log_path.read_text() == output
    assert error.log_path.parent == tmp_path / "logs"
    if cause == "gated":
        assert "https://huggingface.co/org/model)" in error.hint
    if cause == "error":
        assert error.message.endswith(f": {last_line}") and "environments/mace.py" in error.hint


def test_signals_and_timeouts_come_before_the_output(tmp_path: Path):
    # A worker killed mid-download may have logged a network retry first.
    assert failure(tmp_path, "ConnectionError: retrying", exit_code=-9).cause == "killed"
    killed = failure(tmp_path, "", exit_code=-15)
    assert "signal 15 (SIGTERM)" in killed.message and "out-of-memory" not in killed.message
    slow = failure(tmp_path, "URLError: timed out", exit_code=None, timed_out=True)
    assert slow.cause == "timeout" and "--download-timeout SECONDS" in slow.hint


def test_an_output_that_cannot_be_saved_is_shown(tmp_path: Path, monkeypatch):
    (tmp_path / "logs").write_text("not a directory")
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path / "logs" / "tmp"))
    error = failure(tmp_path, "line 1\nKeyError: 'model'\n")
    assert error.log_path is None
    assert "could not be saved" in error.hint and "KeyError: 'model'" in str(error)


GATED_PAGE = "https://huggingface.co/org/model"
GATED_LINE = (
    f"mace-mp-0 is gated: request access at {GATED_PAGE}, "
    "then set HF_TOKEN (or ~/.cache/huggingface/token)"
)


def test_a_hub_refusal_of_declared_gated_weights_is_the_gated_line(tmp_path: Path):
    output = (
        "Traceback (most recent call last):\nurllib.error.HTTPError: HTTP Error 403: Forbidden\n"
    )
    layout = InstallLayout(tmp_path, tmp_path)
    common = {"output": output, "exit_code": 1, "timeout": 60.0, "timed_out": False}
    declared = download_failure(layout, "mace", "mace-mp-0", gated_url=GATED_PAGE, **common)
    assert (declared.cause, declared.message, declared.hint) == ("gated", GATED_LINE, "")
    assert declared.log_path is not None  # the worker's output is still kept
    # Without a declared URL the older two-line message stays.
    plain = download_failure(layout, "mace", "mace-mp-0", **common)
    assert plain.cause == "gated" and plain.message != GATED_LINE and plain.hint
    # A declared URL changes nothing for another cause.
    offline = download_failure(
        layout,
        "mace",
        "mace-mp-0",
        gated_url=GATED_PAGE,
        **{**common, "output": "socket.gaierror: [Errno -2] Name or service not known"},
    )
    assert offline.cause == "network" and "is gated" not in offline.message


def test_gated_weights_need_a_token_before_the_download(tmp_path: Path):
    from rootstock.runtime.download_failure import DownloadFailed, require_hf_token

    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(DownloadFailed) as caught:
        require_hf_token("mace-mp-0", GATED_PAGE, {"HOME": str(home)})
    assert str(caught.value) == GATED_LINE  # one line: no hint, no log
    assert caught.value.cause == "gated" and caught.value.log_path is None
    require_hf_token("mace-mp-0", GATED_PAGE, {"HOME": str(home), "HF_TOKEN": "hf_x"})
    token = home / ".cache" / "huggingface" / "token"
    token.parent.mkdir(parents=True)
    token.write_text("hf_from_file\n")
    require_hf_token("mace-mp-0", GATED_PAGE, {"HOME": str(home)})
