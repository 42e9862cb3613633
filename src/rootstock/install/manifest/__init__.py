"""``{root}/manifest.json``: the install's memory of what is built, fetched and verified.

Treated like a small database (the schema is documented in ``docs/manifest.md``):

* versioned (``schema_version``): older files are migrated on read
  (:mod:`.migrations`); every field is checked on read and before every write
  (:mod:`.validate`); corrupt or newer files are refused with
  :class:`~rootstock.errors.ManifestError` and never written over (:mod:`.parse`);
* every change is a short locked read-modify-write, written to a temp file and
  renamed into place (:mod:`.store`); the ``record_*`` helpers each write one
  record, after the slow work is done (:mod:`.records`);
* the records are declared once, as TypedDicts (:mod:`.types`): plain dicts at
  runtime, checked by mypy, and validated by the dashboard through pydantic;
* the displayed state of a checkpoint (``stale`` included) is derived on read,
  never stored (:mod:`.state`), and re-verifications are compared with the accepted
  reference fingerprint for the same setup kwargs (:mod:`.fingerprints`).

Import the API from here; the submodules are the implementation.
"""

from __future__ import annotations

from rootstock.install.manifest.fingerprints import (
    DEFAULT_TOLERANCE,
    FingerprintComparison,
    FingerprintTolerance,
    QuantityDrift,
    canonical_kwargs,
    compare_fingerprints,
    device_kind,
    kwargs_key,
)
from rootstock.install.manifest.parse import parse_manifest
from rootstock.install.manifest.records import (
    forget_env,
    one_line,
    record_env_build,
    record_fetch,
    record_verification,
    record_weights,
)
from rootstock.install.manifest.schema import (
    ENV_BUILD_FIELDS,
    MANIFEST_VERSION,
    VERIFICATION_STATES,
    new_manifest,
    utc_now,
)
from rootstock.install.manifest.state import (
    DISPLAY_STATES,
    CheckpointState,
    checkpoint_state,
    cluster_view,
    parse_time,
)
from rootstock.install.manifest.store import (
    DEFAULT_LOCK_TIMEOUT,
    ManifestInit,
    ensure_manifest,
    load_manifest,
    manifest_lock_path,
    update_manifest,
)
from rootstock.install.manifest.types import (
    BuildRef,
    CheckpointRecord,
    Checks,
    EnvRecord,
    Fingerprint,
    ImageRecord,
    Manifest,
    QuantityCheck,
    Reference,
    Verification,
    VerificationState,
    WeightFile,
)

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_TOLERANCE",
    "DISPLAY_STATES",
    "ENV_BUILD_FIELDS",
    "MANIFEST_VERSION",
    "VERIFICATION_STATES",
    "BuildRef",
    "CheckpointRecord",
    "CheckpointState",
    "Checks",
    "EnvRecord",
    "Fingerprint",
    "FingerprintComparison",
    "FingerprintTolerance",
    "ImageRecord",
    "Manifest",
    "ManifestInit",
    "QuantityCheck",
    "QuantityDrift",
    "Reference",
    "Verification",
    "VerificationState",
    "WeightFile",
    "canonical_kwargs",
    "checkpoint_state",
    "cluster_view",
    "compare_fingerprints",
    "device_kind",
    "ensure_manifest",
    "forget_env",
    "kwargs_key",
    "load_manifest",
    "manifest_lock_path",
    "new_manifest",
    "one_line",
    "parse_manifest",
    "parse_time",
    "record_env_build",
    "record_fetch",
    "record_verification",
    "record_weights",
    "update_manifest",
    "utc_now",
]
