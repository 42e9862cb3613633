"""The user's ``~/.config/rootstock/config.toml``.

It holds the default root and, for maintainers, the dashboard credentials, so it
is always written with mode 0600.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from rootstock.errors import ConfigError
from rootstock.install.atomic import atomic_write_text

CONFIG_ENV = "ROOTSTOCK_CONFIG"
CONFIG_KEYS = (
    "root",
    "cluster",
    "maintainer_name",
    "maintainer_email",
    "is_maintainer",
    "api_url",
    "api_key",
    "api_secret",
)


def config_path() -> Path:
    """Where config.toml lives: ``$ROOTSTOCK_CONFIG``, else the XDG config dir."""
    override = os.environ.get(CONFIG_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "rootstock" / "config.toml"


def load_config() -> dict[str, Any]:
    """Read config.toml; a missing file is an empty config."""
    path = config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"{path} is not valid TOML: {exc}",
            hint="fix the file by hand, or move it aside and re-run `rootstock init`",
        ) from None
    return data


def save_config(values: dict[str, Any]) -> Path:
    """Write ``values`` (flat strings and booleans) to config.toml with mode 0600."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Written by `rootstock init`. Holds API secrets: keep it mode 0600."]
    for key in CONFIG_KEYS:
        if values.get(key) is not None:
            lines.append(f"{key} = {_toml_value(values[key])}")
    for key in sorted(set(values) - set(CONFIG_KEYS)):
        if values[key] is not None:
            lines.append(f"{key} = {_toml_value(values[key])}")
    atomic_write_text(path, "\n".join(lines) + "\n", mode=0o600)
    return path


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'
