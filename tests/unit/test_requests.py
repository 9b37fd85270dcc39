"""The controller's typed requests (server/requests.py) against the specs that check
the bodies they are made of (server/api.py): the same fields, the same defaults, so
a body checked by its spec always makes its request, and a request built in code (a
pause's BRANCH, a workspace's spawn) means what the same body would."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from vmfork.server import api, requests
from vmfork.server.errors import BadRequest
from vmfork.server.validation import Field, validate_fields

PAIRS: list[tuple[type[Any], dict[str, Field]]] = [
    (requests.SnapshotCreate, api.SNAPSHOT_CREATE),
    (requests.SandboxCreate, api.SANDBOX_CREATE),
    (requests.Branch, api.BRANCH),
    (requests.Exec, api.EXEC),
    (requests.Eval, api.EVAL),
    (requests.RemoveFile, api.REMOVE_QUERY),
    (requests.PortExpose, api.PORT_EXPOSE),
    (requests.Egress, api.EGRESS),
    (requests.WorkspaceCreate, api.WORKSPACE_CREATE),
]


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


@pytest.mark.parametrize(("cls", "spec"), PAIRS, ids=[c.__name__ for c, _ in PAIRS])
def test_each_request_has_its_specs_fields_and_defaults(cls: type[Any],
                                                        spec: dict[str, Field]) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(fields) == set(spec)
    for name, field in spec.items():
        if field.required:
            assert _default(fields[name]) is dataclasses.MISSING, name
        else:
            assert _default(fields[name]) == field.default, name


def test_a_checked_body_makes_its_request_and_the_request_is_frozen() -> None:
    body = validate_fields({"snapshot_tag": "base", "n": 3, "metadata": {"k": "v"}},
                           api.SANDBOX_CREATE, "POST /v1/sandboxes")
    request = requests.SandboxCreate.of(body)
    assert request == requests.SandboxCreate(snapshot_tag="base", n=3, metadata={"k": "v"})
    assert request.on_timeout == "kill" and request.timeout_secs is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.n = 4  # type: ignore[misc]
    assert request.replace(n=4).n == 4 and request.n == 3


def test_a_bad_body_is_refused_by_its_spec_before_any_request_exists() -> None:
    with pytest.raises(BadRequest, match="unknown field 'timeout_sec'"):
        requests.Exec.of(validate_fields({"args": ["true"], "timeout_sec": 1}, api.EXEC,
                                         "POST /v1/sandboxes/x/exec"))


def test_egress_request_is_the_policy_form_networking_reads() -> None:
    from vmfork.server.networking import egress_policy
    body = validate_fields({"mode": "allowlist", "cidrs": ["10.0.0.0/8"]}, api.EGRESS,
                           "PUT egress")
    policy = egress_policy(requests.Egress.of(body).as_policy_spec())
    assert policy is not None and policy.mode == "allowlist"
