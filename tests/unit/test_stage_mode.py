"""How a worker is staged: the ``stage`` setting's precedence and its clear errors."""

from __future__ import annotations

import pytest

from rootstock.errors import ConfigError, UsageError
from rootstock.runtime.stage import STAGE_ENV, STAGE_IDLE_ENV, idle_timeout, stage_mode


@pytest.fixture
def config(tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(path))
    monkeypatch.delenv(STAGE_ENV, raising=False)
    return path


def test_the_keyword_beats_the_variable_which_beats_config_toml(config, monkeypatch):
    assert stage_mode() == "auto"
    config.write_text('stage = "copy"\n')
    assert stage_mode() == "copy"
    monkeypatch.setenv(STAGE_ENV, "Mount")
    assert stage_mode() == "mount"
    assert stage_mode("off") == "off"


@pytest.mark.parametrize(
    ("where", "value", "named"),
    [("keyword", "fast", "stage="), ("variable", "yes", "$ROOTSTOCK_STAGE")],
)
def test_an_unknown_mode_is_a_usage_error_naming_where_it_came_from(
    config, monkeypatch, where, value, named
):
    explicit = value if where == "keyword" else None
    if where == "variable":
        monkeypatch.setenv(STAGE_ENV, value)
    with pytest.raises(UsageError) as caught:
        stage_mode(explicit)
    assert named in caught.value.message
    assert "auto, mount, copy, off" in caught.value.message


@pytest.mark.parametrize("line", ['stage = "nope"', "stage = 1"])
def test_a_bad_stage_in_config_toml_is_a_config_error_naming_the_file(config, line):
    config.write_text(line + "\n")
    with pytest.raises(ConfigError) as caught:
        stage_mode()
    assert str(config) in caught.value.message
    assert "stage must be one of auto, mount, copy, off" in caught.value.message
    assert 'stage = "auto"' in (caught.value.hint or "")


def test_the_idle_timeout_is_a_number_of_seconds(monkeypatch):
    monkeypatch.delenv(STAGE_IDLE_ENV, raising=False)
    assert idle_timeout() == 600.0
    monkeypatch.setenv(STAGE_IDLE_ENV, "2.5")
    assert idle_timeout() == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(STAGE_IDLE_ENV, bad)
        with pytest.raises(UsageError, match=STAGE_IDLE_ENV):
            idle_timeout()
