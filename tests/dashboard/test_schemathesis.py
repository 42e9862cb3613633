"""Property-based tests of the API from the server's own OpenAPI schema (schemathesis).

Schemathesis reads ``/api/v1/openapi.json`` from the live server and sends
generated requests, valid and invalid, to every operation. The path's cluster of
every write is set to one that the supplied key may write to, so the generated bodies reach
validation and storage instead of stopping at a 403. No request may get a 5xx,
and every response must be one the schema documents, in the documented shape.

Example counts are bounded so the whole file runs in well under a minute.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode

from tests.dashboard import manifests
from tests.dashboard.conftest import Dashboard

MAX_EXAMPLES = 40
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

pytestmark = pytest.mark.timeout(300)


def _schema_for(dashboard: Dashboard):
    cluster, auth = dashboard.cluster_with_key("fuzz")
    # One real push first, so the reads of this cluster answer 200 as well as 404.
    pushed = httpx.put(
        f"{dashboard.url}api/v1/clusters/{cluster}/manifest",
        json=manifests.manifest(
            cluster, {"mace": {"mace-mp-0": {"gpu": manifests.record("mace")}}}
        ),
        headers=auth,
        timeout=30,
    )
    assert pushed.status_code == 200, pushed.text
    config = SchemathesisConfig.from_dict(
        {
            "base-url": f"{dashboard.url}api/v1",
            "headers": auth,
            "generation": {"max-examples": MAX_EXAMPLES, "deterministic": False},
        }
    )
    schema = schemathesis.openapi.from_url(f"{dashboard.url}api/v1/openapi.json", config=config)
    return schema, auth, cluster


OPERATIONS = [
    ("PUT", "/clusters/{cluster}/manifest"),
    ("POST", "/clusters/{cluster}/usage"),
    ("GET", "/clusters/{cluster}/manifest"),
    ("GET", "/clusters/{cluster}/pushes"),
    ("GET", "/clusters"),
    ("GET", "/coverage"),
    ("GET", "/catalogue"),
]
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.system)]


@pytest.fixture(scope="module", params=BACKENDS)
def api_schema(request):
    """The live server's OpenAPI schema (per backend) and the key header it was set up with."""
    return _schema_for(request.getfixturevalue(f"{request.param}_dashboard"))


def test_schema_lists_every_operation(api_schema):
    schema, _, _ = api_schema
    found = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert found == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_api_has_no_server_errors(api_schema, method, path):
    schema, auth, cluster = api_schema
    operation = schema[path][method]
    strategy = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    @given(case=strategy, pin=st.booleans())
    def check(case, pin):
        if "{cluster}" in path and (pin or method != "GET"):
            # Writes always go to the key's own cluster, so their bodies get past the
            # 403 into validation and storage; reads try it and generated names.
            case.path_parameters = {**(case.path_parameters or {}), "cluster": cluster}
            body = case.body
            if pin and isinstance(body, dict) and isinstance(body.get("clusters"), list):
                # ... and half of the manifests name it, so that some get stored.
                body["clusters"] = [*body["clusters"], cluster]
        case.call_and_validate(headers=auth, checks=CHECKS, timeout=30)

    check()
