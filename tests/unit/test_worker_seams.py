"""The typed seams of the worker path (issue #14), in-process: nothing is spawned.

* ``WorkerDiedError.worker_exit_code`` is the worker's status; the CLI still exits
  with the class's ``exit_code`` (1), never with the worker's code.
* ``serve`` and ``benchmark`` hand one :class:`WorkerOptions` down to ``ops``, and
  the calculator's keywords resolve to the same :class:`WorkerSpec` as the options.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from rootstock.cli.main import main
from rootstock.errors import RootstockError, WorkerDiedError, WorkerError
from rootstock.ops.init import InitRequest, init_root
from rootstock.runtime.calculator import RootstockCalculator
from rootstock.runtime.spec import WorkerOptions, resolve_worker_spec

pytestmark = pytest.mark.timeout(60)

SAMPLE_EMT = Path(__file__).resolve().parents[2] / "environments" / "emt.py"


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An initialised root with a FAKE emt env (its env_source.py, no interpreter)."""
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "no-config.toml"))
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    root = tmp_path / "root"
    init_root(InitRequest(root=root, cluster="box"))
    (root / "envs" / "emt").mkdir(parents=True)
    shutil.copyfile(SAMPLE_EMT, root / "envs" / "emt" / "env_source.py")
    return root


# --- WorkerDiedError ---------------------------------------------------------------


@pytest.mark.parametrize("code", [9, 2, -signal.SIGKILL, None])
def test_worker_died_error_keeps_the_worker_code_apart_from_the_cli_code(code):
    err = WorkerDiedError("the worker for 'emt' died", worker_exit_code=code, output_tail="x")
    assert err.worker_exit_code == code
    assert err.exit_code == RootstockError.exit_code == 1
    assert "exit_code" not in vars(err)  # no instance attribute shadows the class's
    assert isinstance(err, WorkerError)
    assert f"(exit code {code})" in str(err)


@pytest.mark.parametrize("code", [9, 2, -signal.SIGKILL])
def test_the_cli_exits_1_whatever_code_the_worker_died_with(monkeypatch, capsys, tmp_path, code):
    def died(*_args: Any, **_kwargs: Any) -> None:
        raise WorkerDiedError("the worker for 'emt' died", worker_exit_code=code)

    monkeypatch.setattr("rootstock.ops.serve.serve", died)
    argv = ["serve", "emt", "--socket", str(tmp_path / "s"), "--device", "cpu"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"error: the worker for 'emt' died (exit code {code})" in err


# --- one WorkerOptions from the CLI to ops ------------------------------------------


def test_serve_hands_one_options_object_to_ops(monkeypatch, tmp_path):
    from rootstock.ops.serve import ServeResult

    seen: dict[str, Any] = {}

    def fake_serve(checkpoint: str, socket_path: str, options: WorkerOptions, **kw: Any):
        seen.update(checkpoint=checkpoint, socket=socket_path, options=options, **kw)
        return ServeResult(checkpoint, "emt", str(socket_path), 1, 0)

    monkeypatch.setattr("rootstock.ops.serve.serve", fake_serve)
    code = main(
        [
            "serve",
            "emt",
            "--socket",
            str(tmp_path / "s"),
            "--device",
            "cpu",
            "--kwarg",
            "a=1",
            "--weights",
            "w.pt",
            "--root",
            str(tmp_path / "root"),
            "--connect-timeout",
            "5",
        ]
    )
    assert code == 0
    assert seen["options"] == WorkerOptions(
        root=str(tmp_path / "root"), device="cpu", setup_kwargs={"a": 1}, weights="w.pt"
    )
    assert (seen["checkpoint"], seen["socket"]) == ("emt", str(tmp_path / "s"))
    assert (seen["structure"], seen["connect_timeout"]) == (None, 5.0)


def test_benchmark_hands_one_options_object_to_ops(monkeypatch, capsys, tmp_path):
    from rootstock.ops.benchmark import BenchmarkReport
    from rootstock.ops.benchmark_system import parse_system

    seen: dict[str, Any] = {}

    def fake_benchmark(checkpoints: list[str], options: WorkerOptions, **kw: Any):
        seen.update(checkpoints=checkpoints, options=options, **kw)
        return BenchmarkReport(parse_system("H2O"), options.device, 0, 1, [])

    monkeypatch.setattr("rootstock.ops.benchmark.benchmark", fake_benchmark)
    argv = ["benchmark", "emt", "lj", "--device", "cpu", "--system", "H2O", "--calls", "1"]
    code = main([*argv, "--warmup", "0", "--cluster", "box", "--json"])
    assert code == 0
    assert seen["checkpoints"] == ["emt", "lj"]
    assert seen["options"] == WorkerOptions(cluster="box", device="cpu")
    assert (seen["system"], seen["calls"], seen["warmup"]) == ("H2O", 1, 0)
    assert json.loads(capsys.readouterr().out)["device"] == "cpu"


def test_the_calculator_keywords_resolve_like_the_options(install: Path):
    options = WorkerOptions(root=install, device="cpu", setup_kwargs={"a": 1})
    spec = resolve_worker_spec("emt", options)
    assert (spec.checkpoint, spec.env_name, spec.device) == ("emt", "emt", "cpu")
    assert spec.setup_kwargs == {"a": 1} and spec.weights is None
    calc = RootstockCalculator("emt", root=install, device="cpu", setup_kwargs={"a": 1})
    assert calc.spec == spec
    assert RootstockCalculator.from_spec(spec).spec is spec
