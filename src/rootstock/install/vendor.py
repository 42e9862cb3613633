"""Vendoring the running rootstock into ``{root}/wheels/`` as a wheel.

Every env gets rootstock from this file (by path, ``--no-deps``), so rebuilds never
depend on a registry still serving the release, and the public, unrelated PyPI
package that is also called ``rootstock`` can never be picked up by name. The
wheel is assembled from the installed package's own files, so it works the same
for a release install and for an editable development checkout. Its local version
label is a hash of the contents, so a changed client never reuses a stale wheel.
"""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile
from pathlib import Path

from rootstock.install.atomic import atomic_write_bytes

_ZIP_DATE = (2020, 1, 1, 0, 0, 0)


def _package_files() -> list[tuple[str, bytes]]:
    package_dir = Path(__file__).resolve().parents[1]
    files = []
    for path in sorted(package_dir.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            arcname = "rootstock/" + path.relative_to(package_dir).as_posix()
            files.append((arcname, path.read_bytes()))
    return files


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def build_wheel_bytes() -> tuple[str, bytes]:
    """Return ``(filename, bytes)`` of a wheel of the running rootstock."""
    from rootstock.version import __version__

    files = _package_files()
    content_hash = hashlib.sha256()
    for name, data in files:
        content_hash.update(name.encode() + b"\0" + data + b"\0")
    version = f"{__version__}+h{content_hash.hexdigest()[:12]}"
    dist_info = f"rootstock-{version}.dist-info"
    metadata = (
        "Metadata-Version: 2.1\nName: rootstock\n"
        f"Version: {version}\n"
        "Summary: Rootstock worker side (vendored into each env; installed with --no-deps)\n"
    ).encode()
    wheel_meta = (
        b"Wheel-Version: 1.0\nGenerator: rootstock\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files += [(f"{dist_info}/METADATA", metadata), (f"{dist_info}/WHEEL", wheel_meta)]
    record_lines = [f"{name},{_record_hash(data)},{len(data)}" for name, data in files]
    record_lines.append(f"{dist_info}/RECORD,,")
    files.append((f"{dist_info}/RECORD", ("\n".join(record_lines) + "\n").encode()))

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files:
            info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, data)
    return f"rootstock-{version}-py3-none-any.whl", buffer.getvalue()


def vendor_wheel(wheels_dir: Path) -> Path:
    """Make sure the running rootstock's wheel is in ``wheels_dir``; return its path."""
    filename, data = build_wheel_bytes()
    target = Path(wheels_dir) / filename
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, data)
    return target
