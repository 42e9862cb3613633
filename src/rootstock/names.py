"""The names rootstock stores and passes around: cluster names and device strings.

One rule each, used by every reader and writer (the CLI, the manifest, the
registry, config.toml and the dashboard), so a name one part accepts is never
refused by another. Cluster names are case-insensitive and stored lower-case.

A stored name written by an older rootstock that the rule now refuses is not an
error on read (the install stays usable): :func:`warn_stored_name` says how to
fix it. Writing such a name again is refused.
"""

from __future__ import annotations

import re
import warnings

from rootstock.errors import UsageError

# The dashboard's URL rule (``/api/v1/clusters/<name>/...``), which every store shares.
CLUSTER_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
CLUSTER_NAME_RULE = (
    "1 to 64 characters: lower-case letters, digits, '.', '_' and '-', "
    "starting with a letter or digit"
)
# The device strings ``device_kind`` understands; anything else (a path, a space)
# would become a manifest key or reach torch as garbage.
DEVICE_PATTERN = re.compile(r"cpu|mps|rocm|hip|(?:cuda|xpu|gpu)(?::[0-9]{1,3})?")
DEVICE_RULE = "cpu, cuda[:N], xpu[:N], gpu[:N], mps, rocm or hip"


class StoredNameWarning(UserWarning):
    """A file holds a name that today's rule refuses; it is read, and the fix named."""


def is_cluster_name(name: object) -> bool:
    """True if ``name`` is already a valid, normalised (lower-case) cluster name."""
    return isinstance(name, str) and CLUSTER_NAME_PATTERN.fullmatch(name) is not None


def cluster_name(name: object, what: str = "cluster name") -> str:
    """``name`` stripped and lower-cased, if that is a valid cluster name.

    Raises :class:`~rootstock.errors.UsageError` (exit code 2) naming the rule.
    """
    cleaned = name.strip().lower() if isinstance(name, str) else None
    if not cleaned:
        raise UsageError(f"a {what} cannot be empty", hint="pass --cluster NAME")
    if not is_cluster_name(cleaned):
        raise UsageError(
            f"{name!r} is not a valid {what}",
            hint=f"a cluster name is {CLUSTER_NAME_RULE}",
        )
    return cleaned


def is_device_name(device: object) -> bool:
    """True if ``device`` is one of the device strings rootstock understands."""
    return isinstance(device, str) and DEVICE_PATTERN.fullmatch(device) is not None


def device_name(device: object, what: str = "device") -> str:
    """``device`` stripped, if it is a device string rootstock understands.

    Raises :class:`~rootstock.errors.UsageError` (exit code 2) listing the accepted set.
    """
    cleaned = device.strip() if isinstance(device, str) else device
    if not is_device_name(cleaned):
        raise UsageError(f"{device!r} is not a valid {what}", hint=f"use {DEVICE_RULE}")
    return str(cleaned)


def warn_stored_name(kind: str, value: object, where: str, fix: str) -> None:
    """Warn that ``where`` holds a ``kind`` (cluster name, device) the rule now refuses."""
    warnings.warn(
        StoredNameWarning(f"{where} holds {kind} {value!r}, which is no longer valid; {fix}"),
        stacklevel=3,
    )
