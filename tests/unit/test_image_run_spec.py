"""``--run`` steps in the definition: CLI flags (in order, after -f's), TOML, the REST
body, validation, and the step's cache key (what a rebuild reuses)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from vmfork.cli.image import register, spec_from_args
from vmfork.image.buildrun import egress_policy, step_key
from vmfork.image.spec import ImageSpec, SpecError, spec_from_toml


def _args(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["image", "build", "x", *words])


def test_cli_run_steps_keep_their_order_after_the_files(tmp_path: Path) -> None:
    toml = tmp_path / "image.toml"
    toml.write_text('run = ["echo from-file"]\negress = "10.0.0.0/8,example.org"\n'
                    'run_mem_mib = 512\n')
    spec = spec_from_args(_args("-f", str(toml), "--run", "echo a", "--run", "pip install b"))
    assert spec.run == ("echo from-file", "echo a", "pip install b")
    assert spec.egress == "10.0.0.0/8,example.org" and spec.run_mem_mib == 512
    assert not spec.is_default
    assert spec.summary()["run"] == list(spec.run)
    only = spec_from_args(_args("--run", "true", "--egress", "deny", "--run-mem-mib", "2048"))
    assert (only.run, only.egress, only.run_mem_mib) == (("true",), "deny", 2048)


@pytest.mark.parametrize("spec, why", [
    (ImageSpec(run=("",)), "non-empty shell command"),
    (ImageSpec(run=("a\0b",)), "without NUL"),
    (ImageSpec(run=("x" * (65 << 10),)), "at most 64 KiB"),
    (ImageSpec(run=("true",), root="initramfs"), "disk root"),
    (ImageSpec(egress="deny"), "there are none"),
    (ImageSpec(run=("true",), egress=","), "egress"),
    (ImageSpec(run=("true",), egress="not a domain!"), "not a domain name"),
    (ImageSpec(run=("true",), run_mem_mib=64), "run_mem_mib"),
    (ImageSpec(run=("true",) * 513), "at most 512"),
])
def test_bad_run_definitions_are_refused(spec: ImageSpec, why: str) -> None:
    with pytest.raises(SpecError, match=why):
        spec.validate()


def test_toml_types_are_checked(tmp_path: Path) -> None:
    toml = tmp_path / "image.toml"
    toml.write_text("run = [1]\n")
    with pytest.raises(SpecError, match="run: must be a list of strings"):
        spec_from_toml(toml)
    toml.write_text('run = ["true"]\nrun_mem_mib = "lots"\n')
    with pytest.raises(SpecError, match="run_mem_mib"):
        spec_from_toml(toml)


def test_egress_policies_read_as_snapshot_takes_them() -> None:
    assert egress_policy(None).mode == "allow" and egress_policy("deny").mode == "deny"
    policy = egress_policy("198.51.100.0/24, pypi.example.org")
    assert policy.mode == "allowlist" and policy.cidrs == ("198.51.100.0/24",)
    assert policy.domains == ("pypi.example.org",)


def test_the_step_key_is_the_disk_so_far_the_command_and_the_egress() -> None:
    base = step_key("a" * 64, "pip install six", None)
    assert base == step_key("a" * 64, "pip install six", "allow")
    assert len({base, step_key("b" * 64, "pip install six", None),
                step_key("a" * 64, "pip install six ", None),
                step_key("a" * 64, "pip install six", "deny")}) == 4


def test_the_rest_body_carries_run_steps() -> None:
    from vmfork.server.images import spec_from_body

    body = {"from": None, "apt": [], "pip": [], "pip_index_url": None, "pip_find_links": [],
            "pip_no_index": False, "npm": [], "copy": [], "env": {}, "workdir": None,
            "user": None, "disk_format": "erofs", "run": ["echo hi"], "egress": "deny",
            "run_mem_mib": 768}
    spec = spec_from_body(body, None)
    assert (spec.run, spec.egress, spec.run_mem_mib) == (("echo hi",), "deny", 768)
    from vmfork.server.errors import BadRequest
    with pytest.raises(BadRequest, match="egress"):
        spec_from_body({**body, "run": []}, None)
