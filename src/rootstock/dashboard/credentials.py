"""Clusters and API keys: issue, scope, revoke, list and authenticate.

A key is a public id (``rsk_<24 hex>``) plus a secret (32 random bytes, URL-safe
base64) printed once. Only a salted HMAC-SHA256 of the secret is stored. A slow
password hash would add nothing here: the secret is random with 256 bits of
entropy, so it cannot be guessed from its hash, and a fast hash keeps every push
cheap. Digests are compared with :func:`hmac.compare_digest`.

Callers own the transaction: these functions flush but never commit.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from rootstock.dashboard.models import ApiKey, ApiKeyCluster, Cluster, utc_now
from rootstock.errors import RootstockError, UnknownCluster, UsageError
from rootstock.names import CLUSTER_NAME_RULE, is_cluster_name

KEY_PREFIX = "rsk_"
KEY_ID_PATTERN = re.compile(r"rsk_[0-9a-f]{24}")
SECRET_PATTERN = re.compile(r"[A-Za-z0-9_-]{16,128}")
HASH_SCHEME = "hmac-sha256"
# Hashed in place of a missing key, so an unknown key id costs the same as a known one.
_DUMMY_HASH = f"{HASH_SCHEME}${'00' * 16}${'00' * 32}"


class CredentialError(RootstockError):
    """A key or cluster operation was refused (unknown key, duplicate cluster, ...)."""


class AuthenticationFailed(CredentialError):
    """The ``Authorization`` header does not name a valid, unrevoked key and secret."""


@dataclass(frozen=True)
class IssuedKey:
    """A freshly issued key: the only time the secret exists outside the client."""

    key_id: str
    secret: str
    maintainer: str
    clusters: list[str]

    def to_dict(self) -> dict[str, Any]:
        """The ``issue-key --json`` shape."""
        return {
            "api_key": self.key_id,
            "api_secret": self.secret,
            "maintainer": self.maintainer,
            "clusters": list(self.clusters),
        }


def validate_cluster_name(name: str) -> str:
    """``name`` if it is a valid cluster name as stored (:mod:`rootstock.names`)."""
    if not is_cluster_name(name):
        raise UsageError(
            f"{name!r} is not a valid cluster name", hint=f"a cluster name is {CLUSTER_NAME_RULE}"
        )
    return name


def hash_secret(secret: str, salt: bytes | None = None) -> str:
    """``hmac-sha256$<salt hex>$<digest hex>`` of ``secret``."""
    salt = secrets.token_bytes(16) if salt is None else salt
    digest = hmac.new(salt, secret.encode(), hashlib.sha256).hexdigest()
    return f"{HASH_SCHEME}${salt.hex()}${digest}"


def secret_matches(secret: str, stored: str) -> bool:
    """Whether ``secret`` hashes to ``stored``, compared in constant time."""
    try:
        scheme, salt_hex, digest_hex = stored.split("$")
        salt = bytes.fromhex(salt_hex)
    except ValueError:
        return False
    if scheme != HASH_SCHEME:
        return False
    digest = hmac.new(salt, secret.encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(digest, digest_hex)


def find_cluster(session: Session, name: str) -> Cluster | None:
    """The cluster called ``name``, or None."""
    return session.scalars(select(Cluster).where(Cluster.name == name)).one_or_none()


def add_cluster(session: Session, name: str) -> Cluster:
    """Create the cluster ``name``; refuse a duplicate."""
    validate_cluster_name(name)
    if find_cluster(session, name) is not None:
        raise CredentialError(
            f"the dashboard already has a cluster {name!r}",
            hint="issue a key for it: rootstock dashboard issue-key "
            f"--cluster {name} --maintainer EMAIL",
        )
    cluster = Cluster(name=name, created_at=utc_now())
    session.add(cluster)
    try:
        session.flush()
    except IntegrityError:
        # Another process added the same name between our check and our insert.
        raise CredentialError(f"the dashboard already has a cluster {name!r}") from None
    return cluster


def list_clusters(session: Session) -> list[Cluster]:
    """Every cluster, by name."""
    return list(session.scalars(select(Cluster).order_by(Cluster.name)))


def issue_key(session: Session, clusters: list[str], maintainer: str) -> IssuedKey:
    """A new key scoped to ``clusters`` (which must exist), for ``maintainer``."""
    maintainer = (maintainer or "").strip()
    if not maintainer or len(maintainer) > 254 or "@" not in maintainer:
        raise UsageError(
            f"--maintainer {maintainer!r} is not an email address",
            hint="pass the email of the key's holder, e.g. --maintainer ops@example.org",
        )
    names = list(dict.fromkeys(clusters))
    if not names:
        raise UsageError("a key needs at least one cluster", hint="pass --cluster NAME")
    rows = []
    for name in names:
        cluster = find_cluster(session, name)
        if cluster is None:
            raise UnknownCluster(
                f"the dashboard has no cluster {name!r}",
                hint=f"add it first: rootstock dashboard add-cluster {name}",
            )
        rows.append(cluster)
    key_id = KEY_PREFIX + secrets.token_hex(12)
    secret = secrets.token_urlsafe(32)
    key = ApiKey(
        key_id=key_id,
        secret_hash=hash_secret(secret),
        maintainer=maintainer,
        created_at=utc_now(),
    )
    session.add(key)
    session.flush()
    session.add_all(ApiKeyCluster(api_key_id=key.id, cluster_id=c.id) for c in rows)
    session.flush()
    return IssuedKey(key_id=key_id, secret=secret, maintainer=maintainer, clusters=names)


def revoke_key(session: Session, key_id: str) -> ApiKey:
    """Revoke ``key_id`` (revoking a revoked key keeps its first revocation time)."""
    key = session.scalars(select(ApiKey).where(ApiKey.key_id == key_id)).one_or_none()
    if key is None:
        raise CredentialError(
            f"the dashboard has no key {key_id!r}",
            hint="list the keys with: rootstock dashboard keys",
        )
    if key.revoked_at is None:
        key.revoked_at = utc_now()
        session.flush()
    return key


def key_clusters(session: Session, key: ApiKey) -> list[str]:
    """The names of the clusters ``key`` may write to."""
    query = (
        select(Cluster.name)
        .join(ApiKeyCluster, ApiKeyCluster.cluster_id == Cluster.id)
        .where(ApiKeyCluster.api_key_id == key.id)
        .order_by(Cluster.name)
    )
    return list(session.scalars(query))


def list_keys(session: Session) -> list[dict[str, Any]]:
    """Every key (never a secret or its hash): the ``keys --json`` rows."""
    scopes: dict[int, list[str]] = {}
    query = (
        select(ApiKeyCluster.api_key_id, Cluster.name)
        .join(Cluster, ApiKeyCluster.cluster_id == Cluster.id)
        .order_by(Cluster.name)
    )
    for key_pk, name in session.execute(query):
        scopes.setdefault(key_pk, []).append(name)
    keys = session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.key_id))
    return [
        {
            "api_key": key.key_id,
            "maintainer": key.maintainer,
            "clusters": scopes.get(key.id, []),
            "created_at": _iso(key.created_at),
            "revoked_at": _iso(key.revoked_at),
        }
        for key in keys
    ]


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(timespec="seconds")


def parse_authorization(header: str | None) -> tuple[str, str]:
    """``(key_id, secret)`` from ``Bearer <key_id>:<secret>``; AuthenticationFailed if not."""
    if not header:
        raise AuthenticationFailed("missing Authorization header")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed("the Authorization header must be 'Bearer KEY:SECRET'")
    key_id, sep, secret = token.strip().partition(":")
    if not sep or not KEY_ID_PATTERN.fullmatch(key_id) or not SECRET_PATTERN.fullmatch(secret):
        raise AuthenticationFailed("the Authorization header must be 'Bearer KEY:SECRET'")
    return key_id, secret


def authenticate(session: Session, header: str | None) -> ApiKey:
    """The live key that ``header`` names, or :class:`AuthenticationFailed`."""
    key_id, secret = parse_authorization(header)
    key = session.scalars(select(ApiKey).where(ApiKey.key_id == key_id)).one_or_none()
    if key is None:
        secret_matches(secret, _DUMMY_HASH)
        raise AuthenticationFailed("unknown API key")
    if not secret_matches(secret, key.secret_hash):
        raise AuthenticationFailed("wrong secret for this API key")
    if key.revoked_at is not None:
        raise AuthenticationFailed("this API key was revoked")
    return key


def may_write(session: Session, key: ApiKey, cluster: str) -> bool:
    """Whether ``key`` is scoped to the cluster named ``cluster``."""
    query = (
        select(Cluster.id)
        .join(ApiKeyCluster, ApiKeyCluster.cluster_id == Cluster.id)
        .where(ApiKeyCluster.api_key_id == key.id, Cluster.name == cluster)
    )
    return session.execute(query).first() is not None
