"""The rule for which variables reach the command inside the test host."""

from __future__ import annotations

import pytest

from vmfork.testhost.environment import assignments, guest_environment, passes

CALLER = {
    "PATH": "/usr/bin", "HOME": "/root", "TERM": "xterm", "LANG": "C.UTF-8", "LC_ALL": "C",
    "CI": "true", "PYTHONPATH": "src", "PYTHONHASHSEED": "0", "VMFORK_CACHE_DIR": "/c",
    "PYENV_VERSION": "3.11.7", "PYTEST_ADDOPTS": "-x", "XDG_CACHE_HOME": "/x",
    "SSH_AUTH_SOCK": "/run/ssh", "DISPLAY": ":0", "XDG_RUNTIME_DIR": "/run/user/0",
    "LD_PRELOAD": "/evil.so", "SECRET_TOKEN": "s3cret", "VMFORK_IN_TESTHOST": "0",
}


def test_the_allowlist_passes_and_the_rest_stays_out() -> None:
    env = guest_environment(CALLER)
    for name in ("PATH", "HOME", "TERM", "LANG", "LC_ALL", "CI", "PYTHONPATH",
                 "PYTHONHASHSEED", "VMFORK_CACHE_DIR", "PYENV_VERSION", "PYTEST_ADDOPTS",
                 "XDG_CACHE_HOME"):
        assert env[name] == CALLER[name], name
    for name in ("SSH_AUTH_SOCK", "DISPLAY", "XDG_RUNTIME_DIR", "LD_PRELOAD", "SECRET_TOKEN"):
        assert name not in env, name


def test_in_testhost_is_always_one() -> None:
    assert guest_environment(CALLER)["VMFORK_IN_TESTHOST"] == "1"
    assert guest_environment({}, ["VMFORK_IN_TESTHOST=0"])["VMFORK_IN_TESTHOST"] == "1"


def test_env_items_pass_or_set() -> None:
    env = guest_environment(CALLER, ["SECRET_TOKEN", "NEW=a=b", "ABSENT", "PATH=/bin"])
    assert env["SECRET_TOKEN"] == "s3cret"
    assert env["NEW"] == "a=b"
    assert env["PATH"] == "/bin"
    assert "ABSENT" not in env


@pytest.mark.parametrize("item", ["1X=2", "A-B", "=x", "A B=c"])
def test_bad_names_are_refused(item: str) -> None:
    with pytest.raises(ValueError, match="not a valid variable name"):
        guest_environment({}, [item])
    with pytest.raises(ValueError):
        assignments([item])


def test_assignments_keep_only_settings() -> None:
    assert assignments(["A=1", "B", "C="]) == {"A": "1", "C": ""}


def test_caller_variables_with_unexportable_names_are_dropped() -> None:
    assert "PYTHON-X" not in guest_environment({"PYTHON-X": "1"})
    assert passes("PYTHON-X")  # the name rule alone would pass it; the syntax check drops it
