"""``rootstock manifest push`` and ``usage push``: send the install's state to the dashboard.

A shared install serving several clusters pushes one manifest per cluster, each that
cluster's view (:func:`~rootstock.install.manifest.cluster_view`: only its own
verifications), with each env's ``source_hash`` refreshed from the live
``envs/<env>/env_source.py`` so an unverified hotfix shows as stale on the
dashboard too, and each checkpoint's ``info`` (licence, gated URL, citation) from
the env file's ``CHECKPOINT_INFO``, for the dashboard's catalogue. The wire format
is docs/dashboard-api.md; the transport policy (timeouts, capped retries, one retry
of a refused connection) is :mod:`rootstock.ops.http_client`.

Nothing here writes the local manifest: a push only ever reads it, so a failed push
leaves the install exactly as it was, and ``rootstock manifest push`` catches up.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from rootstock.errors import PushError, PushNotConfigured
from rootstock.install.config import config_path, load_config
from rootstock.install.envfile import source_hash
from rootstock.install.envs import scan_installed_envs
from rootstock.install.layout import InstallLayout
from rootstock.install.machine import resolve_cluster, served_clusters
from rootstock.install.manifest import MANIFEST_VERSION, Manifest, cluster_view, load_manifest
from rootstock.install.usage import COUNT_MAX
from rootstock.names import cluster_name
from rootstock.ops.http_client import (
    Deadline,
    HttpOutcome,
    RetryPolicy,
    check_base_url,
    request_json,
)

RETRY_COMMAND = "rootstock manifest push"
USAGE_PAYLOAD_VERSION = 1
CREDENTIAL_KEYS = ("api_url", "api_key", "api_secret")
# The CHECKPOINT_INFO fields a push carries per checkpoint (the dashboard's catalogue).
PUSHED_INFO_FIELDS = ("licence", "gated", "citation")


@dataclass(frozen=True)
class Dashboard:
    """Where pushes go and the credential they carry (from config.toml)."""

    url: str
    key: str
    secret: str = field(repr=False)  # never in a traceback, log line or debug print
    policy: RetryPolicy = field(default_factory=RetryPolicy)

    def endpoint(self, cluster: str, what: str) -> str:
        """``{url}/api/v1/clusters/{cluster}/{what}``."""
        return f"{self.url}/api/v1/clusters/{urllib.parse.quote(cluster, safe='')}/{what}"

    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header every write carries."""
        return {"Authorization": f"Bearer {self.key}:{self.secret}"}


def missing_credentials(config: dict[str, Any]) -> list[str]:
    """The credential keys config.toml lacks (empty when a push can be tried)."""
    return [key for key in CREDENTIAL_KEYS if not str(config.get(key) or "").strip()]


def dashboard_settings(config: dict[str, Any] | None = None) -> Dashboard:
    """The dashboard from config.toml; raises PushNotConfigured naming what is missing."""
    config = load_config() if config is None else config
    missing = missing_credentials(config)
    if missing:
        raise PushNotConfigured(
            f"no dashboard to push to: {', '.join(missing)} missing from {config_path()}",
            hint="ask the dashboard's admin for a key (`rootstock dashboard issue-key`), then "
            "run `rootstock init --force --api-url URL --api-key KEY --api-secret-file FILE`",
        )
    return Dashboard(
        url=check_base_url(str(config["api_url"])),
        key=str(config["api_key"]).strip(),
        secret=str(config["api_secret"]).strip(),
        policy=RetryPolicy.from_settings(config, os.environ),
    )


@dataclass
class ClusterPush:
    """The outcome of one cluster's push."""

    cluster: str
    ok: bool
    status: int | None = None
    attempts: int = 0
    seconds: float = 0.0
    response: dict[str, Any] | None = None
    message: str | None = None
    hint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (one entry of ``manifest push --json``'s ``results``)."""
        return {
            "cluster": self.cluster,
            "ok": self.ok,
            "status": self.status,
            "attempts": self.attempts,
            "seconds": round(self.seconds, 3),
            "response": self.response,
            "message": self.message,
            "hint": self.hint,
        }


@dataclass
class PushReport:
    """Every cluster's outcome of one push (``what`` is ``manifest`` or ``usage``)."""

    what: str
    api_url: str
    results: list[ClusterPush] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every cluster's push succeeded (or there was nothing to send)."""
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[ClusterPush]:
        """The clusters whose push failed, tried or not."""
        return [r for r in self.results if not r.ok]

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` shape of ``manifest push`` and ``usage push``."""
        return {
            "what": self.what,
            "api_url": self.api_url,
            "ok": self.ok,
            "results": [r.to_dict() for r in self.results],
        }

    def error(self) -> PushError:
        """One error describing every failed cluster (for a command that must fail)."""
        failed = self.failures
        lines = [f"{r.cluster}: {r.message}" for r in failed]
        message = f"{self.what} push to {self.api_url} failed" + (
            f" for {lines[0]}" if len(lines) == 1 else ":\n  " + "\n  ".join(lines)
        )
        return PushError(message, hint=next((r.hint for r in failed if r.hint), None))


# --- payloads -----------------------------------------------------------------------------


def manifest_payloads(
    layout: InstallLayout, clusters: Iterable[str] | None = None, manifest: Manifest | None = None
) -> dict[str, Manifest]:
    """One payload per cluster: its view of the manifest, with live source hashes.

    Each checkpoint of an env whose ``env_source.py`` parses also carries ``info``
    (:func:`checkpoint_infos`). ``clusters`` defaults to every cluster the install
    serves. The local manifest is only read; the refreshed hashes and the info
    exist in the payloads alone.
    """
    data = manifest if manifest is not None else load_manifest(layout)
    names = (
        [cluster_name(c) for c in clusters]
        if clusters is not None
        else served_clusters(layout, data)
    )
    live = live_source_hashes(layout, data)
    infos = checkpoint_infos(layout)
    payloads: dict[str, Manifest] = {}
    for name in names:
        view = cluster_view(data, name)
        for env_name, env in view.get("envs", {}).items():
            if env_name in live:
                env["source_hash"] = live[env_name]
            described = infos.get(env_name)
            if described is None:
                continue  # unreadable: sent without info, which the dashboard shows as unknown
            for checkpoint, entry in env.get("checkpoints", {}).items():
                # A payload-only key: the manifest file never holds it.
                cast(dict[str, Any], entry)["info"] = described.get(
                    checkpoint, dict.fromkeys(PUSHED_INFO_FIELDS)
                )
        payloads[name] = view
    return payloads


def checkpoint_infos(layout: InstallLayout) -> dict[str, dict[str, dict[str, str | None]]]:
    """``{env: {checkpoint: info}}`` for every built env whose ``env_source.py`` parses.

    ``info`` holds :data:`PUSHED_INFO_FIELDS` from the env file's ``CHECKPOINT_INFO``,
    each None where the file gives none (``gated`` None: not gated). Broken envs are
    left out, so their checkpoints go without info rather than with wrong info.
    """
    return {
        env.name: {
            checkpoint: {
                field: cast(dict[str, Any], env.checkpoint_info.get(checkpoint, {})).get(field)
                for field in PUSHED_INFO_FIELDS
            }
            for checkpoint in env.checkpoints
        }
        for env in scan_installed_envs(layout).envs
    }


def live_source_hashes(layout: InstallLayout, manifest: Manifest) -> dict[str, str]:
    """The hash of each env's ``env_source.py`` as it is now (envs without one are left out)."""
    hashes = {}
    for name in manifest.get("envs", {}):
        try:
            text = layout.env_source(name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # removed or unreadable: the recorded hash is all there is
        hashes[name] = source_hash(text)
    return hashes


def usage_payload(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The body of ``POST .../usage``: aggregated counts only, never user ids.

    Each count is capped at :data:`~rootstock.install.usage.COUNT_MAX`, the most the
    dashboard stores: a month's force calls, summed over many sessions, can pass it.
    """
    return {
        "version": USAGE_PAYLOAD_VERSION,
        "counts": [
            {
                "month": row["month"],
                "env": row["env"],
                "checkpoint": row["checkpoint"],
                "sessions": min(int(row["sessions"]), COUNT_MAX),
                "distinct_users": min(int(row["users"]), COUNT_MAX),
                "force_calls": min(int(row["force_calls"]), COUNT_MAX),
            }
            for row in rows
        ],
    }


def usage_counts_capped(rows: list[dict[str, Any]]) -> int:
    """How many counts of ``rows`` :func:`usage_payload` sends capped."""
    keys = ("sessions", "users", "force_calls")
    return sum(1 for row in rows for key in keys if int(row[key]) > COUNT_MAX)


# --- pushing ------------------------------------------------------------------------------


def push_manifest(
    layout: InstallLayout,
    clusters: Iterable[str] | None = None,
    dashboard: Dashboard | None = None,
    deadline: Deadline | None = None,
) -> PushReport:
    """``PUT`` each cluster's manifest view to the dashboard; never raises for a failed send.

    ``clusters`` defaults to every cluster the install serves. All clusters share
    one retry deadline (``deadline``, else a fresh one of the policy's cap), and once
    the dashboard proved unreachable the remaining clusters are not tried: a dead
    dashboard costs at most the retry cap.
    """
    dashboard = dashboard or dashboard_settings()
    payloads = manifest_payloads(layout, clusters)
    report = PushReport("manifest", dashboard.url)
    deadline = deadline or Deadline(dashboard.policy.total_cap)
    unreachable: str | None = None
    for cluster, payload in payloads.items():
        if unreachable:
            report.results.append(_not_tried(cluster, unreachable))
            continue
        outcome = request_json(
            "PUT",
            dashboard.endpoint(cluster, "manifest"),
            payload,
            headers=dashboard.headers(),
            policy=dashboard.policy,
            deadline=deadline,
        )
        result = _interpret(cluster, outcome, "manifest")
        report.results.append(result)
        if outcome.status is None:
            unreachable = outcome.error
    return report


def push_usage(
    layout: InstallLayout,
    cluster: str | None = None,
    since: str | None = None,
    dashboard: Dashboard | None = None,
) -> PushReport:
    """``POST`` the install's aggregated monthly usage counts for one cluster.

    Usage records do not say which cluster they came from, so the counts go to
    ``cluster`` (resolved as ``smoke-test`` does: needed on a shared install).
    Months already on the dashboard are replaced, so re-sending never double-counts.
    """
    from rootstock.ops.usage import usage_report

    dashboard = dashboard or dashboard_settings()
    machine = resolve_cluster(layout, cluster)
    rows = usage_report(layout, since=since)["rows"]
    report = PushReport("usage", dashboard.url)
    if not rows:
        report.results.append(
            ClusterPush(machine, ok=True, message="no usage recorded; nothing sent")
        )
        return report
    outcome = request_json(
        "POST",
        dashboard.endpoint(machine, "usage"),
        usage_payload(rows),
        headers=dashboard.headers(),
        policy=dashboard.policy,
    )
    result = _interpret(machine, outcome, "usage")
    capped = usage_counts_capped(rows)
    if result.ok and capped:
        sent = (result.response or {}).get("rows")
        result.message = (
            f"sent {sent} row(s) to {dashboard.url}; {capped} count(s) above {COUNT_MAX}, "
            f"the most the dashboard stores, were sent as {COUNT_MAX}"
        )
    report.results.append(result)
    return report


def _not_tried(cluster: str, reason: str) -> ClusterPush:
    return ClusterPush(
        cluster,
        ok=False,
        message=f"not sent: the dashboard was unreachable ({reason})",
        hint=f"retry with `{RETRY_COMMAND}` once the dashboard is up",
    )


def _interpret(cluster: str, outcome: HttpOutcome, what: str) -> ClusterPush:
    """Turn an HTTP outcome into a result whose message and hint name the fix."""
    result = ClusterPush(cluster, ok=outcome.ok, status=outcome.status, attempts=outcome.attempts)
    result.seconds = outcome.seconds
    body = outcome.json()
    if outcome.ok:
        result.response = body if isinstance(body, dict) else None
        return result
    retry = RETRY_COMMAND if what == "manifest" else "rootstock usage push"
    detail = _detail(body)
    status = outcome.status
    if status is None:
        result.message = outcome.error
        result.hint = f"is the dashboard running? retry with `{retry}` once it is up"
    elif 300 <= status < 400:
        _explain_redirect(result, status, outcome.location)
    elif status == 401:
        result.message = "the dashboard refused the credentials (401)"
        result.hint = f"check api_key and api_secret in {config_path()}"
    elif status == 403:
        result.message = f"the API key is not scoped to cluster {cluster!r} (403)"
        result.hint = (
            "ask the dashboard admin for a key for it: "
            f"`rootstock dashboard issue-key --cluster {cluster} --maintainer EMAIL`"
        )
    elif status == 413:
        result.message = f"the {what} is larger than the dashboard accepts (413)"
        result.hint = "ask the dashboard admin to raise its body limit (serve --max-body)"
    elif status == 422:
        result.message = f"the dashboard rejected the {what} (422): {detail or 'no detail'}"
        result.hint = (
            f"this rootstock writes manifest schema {MANIFEST_VERSION}; "
            "the dashboard may be older than the client: upgrade it"
            if what == "manifest"
            # Counts and names are bounded when read from the spool, so a refusal means
            # a rollup from before the bounds, or a dashboard with other bounds.
            else "run `rootstock usage compact` (it repairs rollups holding names or counts "
            "the dashboard refuses) and push again; if it is still refused, the dashboard "
            "may be older than the client: upgrade it"
        )
    elif status == 404 and detail and "cluster" in detail:
        # The dashboard itself answered: the key is scoped to a cluster it no longer has.
        result.message = f"{detail} (404)"
        result.hint = (
            f"the cluster was removed from the dashboard; ask its admin to add it back "
            f"(`rootstock dashboard add-cluster {cluster}`), then run `{retry}`"
        )
    elif status == 404:
        result.message = "no dashboard API at this address (404)"
        result.hint = (
            "api_url must be the dashboard's base URL (the one whose /api/v1/coverage works)"
        )
    else:
        result.message = f"the dashboard answered HTTP {status}" + (f": {detail}" if detail else "")
        if outcome.attempts > 1:
            result.message += f" (after {outcome.attempts} attempts)"
        result.hint = f"retry later with `{retry}`"
    return result


def _explain_redirect(result: ClusterPush, status: int, location: str | None) -> None:
    """A 3xx is never followed (it would carry the credential along): name the fix."""
    where = f" to {location}" if location else ""
    result.message = f"the dashboard redirected the push{where} ({status}); not followed"
    base = _base_url(location) if location else None
    if base:
        result.hint = f"set api_url in {config_path()} to {base}"
    else:
        result.hint = (
            f"set api_url in {config_path()} to the address the dashboard answers at "
            "directly (often https:// instead of http://)"
        )


def _base_url(location: str) -> str | None:
    """The dashboard base URL a redirect of an API call points at, if it is one."""
    parts = urllib.parse.urlsplit(location)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    path, api, _rest = parts.path.partition("/api/v1/")
    if not api:
        return None
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path.rstrip("/"), "", ""))


def _detail(body: Any) -> str | None:
    """A one-line summary of an error body's ``detail`` (FastAPI's shape)."""
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str):
        return detail[:300]
    if isinstance(detail, list):
        parts = []
        for item in detail[:3]:
            if isinstance(item, dict):
                where = ".".join(str(p) for p in item.get("loc", []))
                parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
            else:
                parts.append(str(item))
        return "; ".join(parts)[:300] or None
    return None
