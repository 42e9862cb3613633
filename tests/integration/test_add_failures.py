"""``add`` failures that name their cause in one line, on real uv-built envs.

A device this node does not show is refused before ``setup()``, never recorded as
verified; a pass is recorded on the device the model really ran on; the
``VERIFY_KWARGS`` hint comes only for a missing ``setup()`` argument; and a failed
download says why (no network, gated weights, a full disk, the out-of-memory
killer, our own timeout, a bug in the env file) and what to do, with the worker's
traceback in a log file whose path it prints. The failures are made by
tests/envs/failing_fetch.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rootstock.install.envs import load_installed_env
from rootstock.install.machine import resolve_layout
from rootstock.ops.verify import run_verification
from tests.conftest import run_rootstock
from tests.integration.conftest import TEST_CLUSTER, TEST_ENVS, build_real_root

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("private_config")]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, shared_uv_cache: Path) -> Path:
    """A private root with the failing-fetch env (a copy of the run's build)."""
    envs = {"failing-fetch": TEST_ENVS / "failing_fetch.py"}
    return build_real_root(tmp_path_factory.mktemp("add-failures") / "root", envs, shared_uv_cache)


def add(root: Path, *args: str, timeout: float = 300):
    """``rootstock add ARGS --root ROOT --no-push``, whatever its exit code."""
    return run_rootstock(
        "add", *args, "--root", root, "--no-push", "--no-perm-check", check=False, timeout=timeout
    )


def error_lines(stderr: str) -> list[str]:
    """The error and what follows it (its hint and log lines), without the progress."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert len(starts) == 1, stderr
    return lines[starts[0] :]


def verifications(root: Path, env: str, checkpoint: str) -> dict:
    data = json.loads((root / "manifest.json").read_text())
    record = data["envs"][env]["checkpoints"][checkpoint]
    return record.get("verifications", {}).get(TEST_CLUSTER, {})


def test_a_device_this_node_does_not_show_is_never_verified(own_root: Path):
    root = own_root
    # EMT has no torch: no CUDA device can be visible to it, here or anywhere.
    for device, name, variable in (
        ([], "CUDA", "CUDA_VISIBLE_DEVICES"),  # the default device, cuda
        (["--device", "xpu"], "XPU", "ZE_AFFINITY_MASK"),
    ):
        proc = add(root, "emt", *device)
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        (line,) = error_lines(proc.stderr)
        assert line.startswith(
            f"error: no {name} device is visible on this node (torch is not installed in "
            f"this env; {variable}="
        ), line
        assert line.endswith("or pass --device cpu"), line
        assert verifications(root, "emt", "emt") == {}, "nothing ran, so nothing is recorded"

    doc = json.loads(add(root, "emt", "--device", "cpu", "--json").stdout)
    assert (doc["state"], doc["device"]) == ("verified", "cpu")
    # mps is not checked; EMT ignores it and runs on the CPU, which is what is recorded.
    doc = json.loads(add(root, "emt", "--device", "mps", "--json").stdout)
    assert (doc["state"], doc["device"]) == ("verified", "cpu")
    (record,) = verifications(root, "emt", "emt").values()
    assert (record["device"], record["device_kind"]) == ("cpu", "cpu")


def test_the_verify_kwargs_hint_only_for_a_missing_setup_argument(
    root: Path, fake_built_root: Path
):
    doc = json.loads(add(root, "needs-head", "--device", "cpu", "--json").stdout)
    assert doc["state"] == "failed"
    assert "setup() missing 1 required keyword-only argument: 'head'" in doc["message"]
    assert "declare it in VERIFY_KWARGS in environments/failing-fetch.py" in doc["message"]

    # An error of the model's own is not a missing keyword (the issue: CHGNet's
    # "Torch not compiled with CUDA enabled" was sent to VERIFY_KWARGS).
    layout = resolve_layout(fake_built_root)
    env = load_installed_env(layout, "broken-setup")
    outcome = run_verification(layout, env, "broken-setup", device="cpu", kwargs=None, timeout=120)
    assert not outcome.passed and "broken on purpose" in outcome.message
    assert "VERIFY_KWARGS" not in outcome.message, outcome.message


# checkpoint -> (extra add options, what the error line says, what its hint says)
DOWNLOAD_FAILURES = {
    "offline": (
        [],
        ["this node cannot reach the network", "Name or service not known"],
        ["rootstock add offline --no-verify", "login node", "then `rootstock add offline`"],
    ),
    "gated": (
        [],
        ["HTTP 403", "gated"],
        ["accept the licence", "https://huggingface.co/example-org/gated-model", "HF_TOKEN"],
    ),
    "disk-full": ([], ["the disk is full", "GiB free"], ["free space on /"]),
    "oom": ([], ["killed by signal 9 (SIGKILL)", "out-of-memory"], ["more memory"]),
    "slow": (
        ["--download-timeout", "4"],
        ["took longer than 4 s"],
        ["rootstock add slow --download-timeout SECONDS"],
    ),
    "buggy": ([], ["KeyError: 'model'"], ["environments/failing-fetch.py"]),
}


@pytest.mark.parametrize("checkpoint", list(DOWNLOAD_FAILURES))
def test_a_failed_download_names_its_cause_and_fix(root: Path, checkpoint: str):
    options, said, hinted = DOWNLOAD_FAILURES[checkpoint]
    proc = add(root, checkpoint, "--no-verify", *options)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    error, hint, log = error_lines(proc.stderr)
    assert error.startswith(f"error: downloading {checkpoint} "), error
    for text in said:
        assert text in error, error
    assert hint.startswith("  hint: "), hint
    for text in hinted:
        assert text in hint, hint
    # A gated or offline node is not the env file's fault.
    assert ("environments/" in hint) == (checkpoint == "buggy"), hint
    assert log.startswith(f"  log: {root / 'logs'}/download-{checkpoint}-"), log
    saved = Path(log.removeprefix("  log: ").split(" (")[0]).read_text()
    if checkpoint != "slow":  # a loaded machine may stop it before its first line
        assert f"fetching {checkpoint}" in saved
    if checkpoint not in ("oom", "slow"):
        assert "Traceback (most recent call last)" in saved


GATED_PAGE = "https://huggingface.co/example-org/gated-model"
GATED_LINE = (
    f"error: gated-declared is gated: request access at {GATED_PAGE}, "
    "then set HF_TOKEN (or ~/.cache/huggingface/token)"
)


@pytest.fixture
def no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No Hugging Face token anywhere the lookup goes: a fresh HOME, no variables."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for variable in ("HF_TOKEN", "HF_TOKEN_FILE", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    return home


def download_logs(root: Path, checkpoint: str) -> list[Path]:
    return sorted((root / "logs").glob(f"download-{checkpoint}-*.log"))


def test_gated_weights_without_a_token_fail_before_the_download(root: Path, no_token: Path):
    proc = add(root, "gated-declared", "--no-verify")
    assert proc.returncode == 1, proc.stderr
    # One line, and no worker ran: it would have left its output in a log file.
    assert error_lines(proc.stderr) == [GATED_LINE]
    assert download_logs(root, "gated-declared") == []
    doc = json.loads(run_rootstock("status", "--root", root, "--json").stdout)
    (env,) = [e for e in doc["envs"] if e["name"] == "failing-fetch"]
    states = {row["id"]: row["states"][TEST_CLUSTER]["state"] for row in env["checkpoints"]}
    # Gated and never fetched reads as gated; an undeclared one stays "not fetched".
    assert states["gated-declared"] == "gated"
    assert states["gated"] == "not fetched"


def test_a_hub_refusing_declared_gated_weights_says_the_same_line(root: Path, no_token: Path):
    # A token (of an account without access) is found, so the download runs: the hub's
    # 403 is then said in the same words, with the worker's log below it.
    token_file = no_token / ".cache" / "huggingface" / "token"
    token_file.parent.mkdir(parents=True)
    token_file.write_text("hf_no_access_to_this_repo\n")
    proc = add(root, "gated-declared", "--no-verify")
    assert proc.returncode == 1, proc.stderr
    error, log = error_lines(proc.stderr)
    assert error == GATED_LINE
    assert log.startswith(f"  log: {root / 'logs'}/download-gated-declared-"), log
    assert "HTTP Error 403" in Path(log.removeprefix("  log: ").split(" (")[0]).read_text()
