"""Property-based fuzzing of the REST API against its own OpenAPI document
(schemathesis): every route, with generated valid and invalid input, must never
answer 5xx (but a documented 501: a refusal of what this build lacks), and every answer
must be documented (status, content type, schema).

The daemon is the real one (``server.daemon.Daemon``: HTTP over TCP, bearer auth,
SQLite registry, store, and a real zygote process as its spawner); it has no guest
image (an empty image cache) and no snapshots, so nothing here boots a VM and the
test runs natively, without KVM.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from vmfork.server.api import openapi_document
from vmfork.server.daemon import Daemon, DaemonConfig

TOKEN = "fuzz-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("fuzz")
    saved = {k: os.environ.get(k) for k in ("VMFORK_CACHE_DIR", "VMFORK_HOME")}
    os.environ["VMFORK_CACHE_DIR"] = str(root / "empty-cache")   # no guest image
    os.environ["VMFORK_HOME"] = str(root / "home")
    (root / "token").write_text(TOKEN + "\n")
    d = Daemon(DaemonConfig(state_dir=root / "state", socket_path=None, bind="127.0.0.1:0",
                            token_file=root / "token", zygote_lease_s=10.0,
                            kill_sandboxes_on_exit=True))
    d.start()
    try:
        yield d
    finally:
        d.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def not_a_server_error_but_501(ctx: Any, response: Any, case: Any) -> bool | None:
    """``not_a_server_error``, except for a 501 the route documents: a deliberate refusal
    of what this build cannot do (POST /v1/images/import while the OCI importer is not
    part of it), not a failure of the daemon."""
    if response.status_code == 501 and "501" in case.operation.definition.raw["responses"]:
        return None
    return not_a_server_error(ctx, response, case)


# The document the daemon serves at /openapi.json (test_server_http checks that it
# lists exactly the routes served).
schema = schemathesis.openapi.from_dict(openapi_document())


@schema.parametrize()
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
def test_no_5xx_and_every_answer_is_documented(daemon: Daemon, case: Any) -> None:
    case.call_and_validate(base_url=daemon.addresses()[0], headers=AUTH, checks=[not_a_server_error_but_501, status_code_conformance,
                                                 content_type_conformance,
                                                 response_schema_conformance])
