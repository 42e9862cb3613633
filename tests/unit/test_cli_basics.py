"""The CLI's contract, in-process: warnings from stored names.

The tests that run the CLI as a user would, in a subprocess (help, error messages,
exit codes, new-env, resolve --json), are in tests/integration/test_cli_basics.py.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_a_stored_name_warning_is_one_warning_line(tmp_path, monkeypatch, capsys):
    # A config written before the one cluster-name rule: it still reads, and the CLI
    # says how to fix it in one line, not Python's file:line warning format.
    config = tmp_path / "config.toml"
    config.write_text('cluster = "Bad Name!"\n')
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(config))
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    from rootstock.cli.main import main

    main(["resolve"])
    err = capsys.readouterr().err
    assert "warning: " + str(config) + " holds cluster name 'Bad Name!'" in err
    assert "StoredNameWarning" not in err
