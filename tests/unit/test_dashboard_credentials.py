"""Clusters and API keys of the dashboard, against a real (migrated) SQLite file."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")

from sqlalchemy import select

from rootstock.dashboard import credentials
from rootstock.dashboard.credentials import AuthenticationFailed, CredentialError
from rootstock.dashboard.db import database_url, make_engine, make_sessionmaker, migrate
from rootstock.dashboard.models import ApiKey
from rootstock.errors import UnknownCluster, UsageError


@pytest.fixture
def sessions(tmp_path: Path):
    engine = make_engine(database_url(tmp_path / "d.db"))
    migrate(engine)
    yield make_sessionmaker(engine)
    engine.dispose()


def header(key: str, secret: str) -> str:
    return f"Bearer {key}:{secret}"


@pytest.mark.parametrize("name", ["delta", "polaris-2", "a.b_c", "0x", "x" * 64])
def test_valid_cluster_names(name: str):
    assert credentials.validate_cluster_name(name) == name


@pytest.mark.parametrize("name", ["", "Delta", "-x", ".x", "a b", "x" * 65, "a/b", "é"])
def test_invalid_cluster_names(name: str):
    with pytest.raises(UsageError):
        credentials.validate_cluster_name(name)


def test_secret_hash_is_salted_and_verifies():
    first, second = credentials.hash_secret("s3cret"), credentials.hash_secret("s3cret")
    assert first != second  # a fresh salt each time
    assert "s3cret" not in first
    assert credentials.secret_matches("s3cret", first)
    assert credentials.secret_matches("s3cret", second)
    assert not credentials.secret_matches("s3creT", first)
    assert not credentials.secret_matches("s3cret", "garbage")
    assert not credentials.secret_matches("s3cret", "md5$00$00")


def test_issue_stores_only_a_hash_and_authenticates(sessions):
    with sessions.begin() as session:
        credentials.add_cluster(session, "delta")
        issued = credentials.issue_key(session, ["delta"], "ops@example.org")
    assert credentials.KEY_ID_PATTERN.fullmatch(issued.key_id)
    assert len(issued.secret) >= 43  # 32 random bytes, URL-safe base64
    with sessions() as session:
        stored = session.scalars(select(ApiKey)).one()
        assert issued.secret not in stored.secret_hash
        key = credentials.authenticate(session, header(issued.key_id, issued.secret))
        assert key.key_id == issued.key_id
        assert credentials.may_write(session, key, "delta")
        assert not credentials.may_write(session, key, "other")
        assert credentials.key_clusters(session, key) == ["delta"]


def test_scope_covers_every_named_cluster_and_no_other(sessions):
    with sessions.begin() as session:
        for name in ("a", "b", "c"):
            credentials.add_cluster(session, name)
        issued = credentials.issue_key(session, ["a", "b", "a"], "ops@example.org")
    assert issued.clusters == ["a", "b"]
    with sessions() as session:
        key = credentials.authenticate(session, header(issued.key_id, issued.secret))
        assert [credentials.may_write(session, key, n) for n in "abc"] == [True, True, False]


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic rsk_000000000000000000000000:abcdefghijklmnopqrstuvwxyz",
        "Bearer rsk_000000000000000000000000",
        "Bearer rsk_000000000000000000000000:",
        "Bearer nope:abcdefghijklmnopqrstuvwxyz",
        "Bearer rsk_000000000000000000000000:short",
        "Bearer rsk_000000000000000000000000:has spaces in the secret",
    ],
)
def test_malformed_headers_are_refused(sessions, value):
    with sessions() as session, pytest.raises(AuthenticationFailed):
        credentials.authenticate(session, value)


def test_unknown_wrong_and_revoked_keys_are_refused(sessions):
    with sessions.begin() as session:
        credentials.add_cluster(session, "delta")
        issued = credentials.issue_key(session, ["delta"], "ops@example.org")
    with sessions() as session:
        with pytest.raises(AuthenticationFailed, match="unknown"):
            credentials.authenticate(session, header("rsk_" + "0" * 24, issued.secret))
        with pytest.raises(AuthenticationFailed, match="wrong secret"):
            credentials.authenticate(session, header(issued.key_id, issued.secret[:-1] + "x"))
        # The scheme is case-insensitive, as HTTP says.
        assert credentials.authenticate(session, f"bearer {issued.key_id}:{issued.secret}")
    with sessions.begin() as session:
        first = credentials.revoke_key(session, issued.key_id).revoked_at
    with sessions.begin() as session:
        assert credentials.revoke_key(session, issued.key_id).revoked_at == first
    with sessions() as session, pytest.raises(AuthenticationFailed, match="revoked"):
        credentials.authenticate(session, header(issued.key_id, issued.secret))


def test_mistakes_name_their_fix(sessions):
    with sessions.begin() as session:
        credentials.add_cluster(session, "delta")
    with sessions.begin() as session, pytest.raises(CredentialError) as dup:
        credentials.add_cluster(session, "delta")
    assert "issue-key" in dup.value.hint
    with sessions.begin() as session, pytest.raises(UnknownCluster) as unknown:
        credentials.issue_key(session, ["nowhere"], "ops@example.org")
    assert "add-cluster nowhere" in unknown.value.hint
    with sessions.begin() as session, pytest.raises(UsageError):
        credentials.issue_key(session, ["delta"], "not-an-email")
    with sessions.begin() as session, pytest.raises(UsageError):
        credentials.issue_key(session, [], "ops@example.org")
    with sessions.begin() as session, pytest.raises(CredentialError) as no_key:
        credentials.revoke_key(session, "rsk_missing")
    assert "dashboard keys" in no_key.value.hint


def test_list_keys_shows_scope_and_state_never_secrets(sessions):
    with sessions.begin() as session:
        credentials.add_cluster(session, "a")
        credentials.add_cluster(session, "b")
        kept = credentials.issue_key(session, ["b", "a"], "one@example.org")
        gone = credentials.issue_key(session, ["a"], "two@example.org")
        credentials.revoke_key(session, gone.key_id)
    with sessions() as session:
        rows = {row["api_key"]: row for row in credentials.list_keys(session)}
    assert rows[kept.key_id]["clusters"] == ["a", "b"]
    assert rows[kept.key_id]["revoked_at"] is None
    assert rows[gone.key_id]["revoked_at"] is not None
    assert set(rows[kept.key_id]) == {
        "api_key",
        "maintainer",
        "clusters",
        "created_at",
        "revoked_at",
    }
    assert kept.secret not in repr(rows)
