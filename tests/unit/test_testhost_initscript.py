"""/init and job.sh: syntax, module list, and argv/env surviving the shell unchanged."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from vmfork.testhost.initscript import Job, render_init, render_job, rw_tag

MODULES = ["virtio_ring", "virtio", "9pnet", "9p", "kvm", "kvm_amd"]
SHELLS = [sh for sh in ("/bin/sh", "/bin/busybox") if Path(sh).exists()]


def test_init_loads_modules_in_the_given_order() -> None:
    init = render_init(MODULES)
    assert init.startswith("#!/bin/sh\n")
    assert "for module in virtio_ring virtio 9pnet 9p kvm kvm_amd; do" in init
    assert "@" not in init.replace("$@", "")


def test_init_mounts_the_root_read_only_with_an_overlay_and_powers_off() -> None:
    init = render_init(MODULES)
    assert "mount9p host /lower ro,cache=loose" in init
    assert "mount -t overlay overlay" in init
    assert 'chroot "$NEWROOT" /usr/bin/env -i "$@" < /dev/null' in init
    assert init.rstrip().endswith("poweroff -f")
    assert "echo $? > /ctl/status" in init


@pytest.mark.parametrize("bad", ["kvm;reboot", "a b", "$(x)", ""])
def test_init_refuses_unsafe_module_names(bad: str) -> None:
    with pytest.raises(ValueError):
        render_init([bad])


@pytest.mark.skipif(not SHELLS, reason="no POSIX shell")
@pytest.mark.parametrize("shell", SHELLS)
def test_init_and_job_parse(shell: str, tmp_path: Path) -> None:
    argv = [shell, "sh", "-n"] if shell.endswith("busybox") else [shell, "-n"]
    init = tmp_path / "init"
    init.write_text(render_init(MODULES))
    subprocess.run([*argv, str(init)], check=True)
    job = tmp_path / "job.sh"
    job.write_text(render_job(Job(["true"], "/", {"PATH": "/bin"}, ["/a"])))
    subprocess.run([*argv, str(job)], check=True)


NASTY = ["python3", "-c", "print('it''s')", "$HOME", "`id`", "a b", "", "tab\there",
         "new\nline", "'", '"', "\\", "*", "--", "-n", "é", "x=y"]
NASTY_ENV = {"PATH": "/usr/bin:/bin", "WEIRD": "a 'b' \"c\" $d `e`\nf", "EMPTY": "",
             "VMFORK_IN_TESTHOST": "1"}


def _source_job(job: Job, tmp_path: Path) -> tuple[list[str], list[str], list[str]]:
    """Source job.sh with stub functions that record their arguments NUL-separated."""
    (tmp_path / "job.sh").write_text(render_job(job))
    stub = (
        'cgroups() { printf "%s\\0" "$@" > cg; }\n'
        'rw_mount() { printf "%s\\0" "$@" >> rw; }\n'
        'run_command() { printf "%s\\0" "$@" > run; }\n'
        ". ./job.sh\n"
    )
    subprocess.run(["/bin/sh", "-c", stub], cwd=tmp_path, check=True)

    def read(name: str) -> list[str]:
        path = tmp_path / name
        return path.read_bytes().decode().split("\0")[:-1] if path.exists() else []

    return read("cg"), read("rw"), read("run")


@pytest.mark.skipif(not Path("/bin/sh").exists(), reason="no /bin/sh")
def test_job_round_trips_argv_env_and_paths_exactly(tmp_path: Path) -> None:
    job = Job(NASTY, "/work/dir with space", NASTY_ENV, ["/srv/a b", "/srv"], "v2")
    cgroup, rw, run = _source_job(job, tmp_path)
    assert cgroup == ["v2"]
    # parents first: /srv (share 1) is mounted before /srv/a b (share 0)
    assert rw == [rw_tag(1), "/srv", rw_tag(0), "/srv/a b"]
    env_words = [f"{k}={v}" for k, v in NASTY_ENV.items()]
    assert run[: len(env_words)] == env_words
    rest = run[len(env_words):]
    assert rest[0:2] == ["/bin/sh", "-c"]
    assert rest[3:5] == ["vmfork-testhost", "/work/dir with space"]
    assert rest[5:] == NASTY


@pytest.mark.skipif(not Path("/bin/sh").exists() or not Path("/usr/bin/env").exists(),
                    reason="no /bin/sh or env")
def test_the_chroot_command_line_cds_and_execs_unchanged(tmp_path: Path) -> None:
    """Run what run_command would hand to chroot, minus the chroot, and compare argv."""
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    echo_args = ["/bin/sh", "-c", 'pwd; printf "%s\\0" "$@"', "argv0", *NASTY]
    job = Job(echo_args, str(workdir), {"PATH": "/usr/bin:/bin", "X": "1 2"})
    _, _, run = _source_job(job, tmp_path)
    done = subprocess.run(["/usr/bin/env", "-i", *run], capture_output=True, check=True,
                          stdin=subprocess.DEVNULL)
    cwd, _, args = done.stdout.decode().partition("\n")
    assert cwd == str(workdir)
    assert args.split("\0")[:-1] == NASTY


@pytest.mark.skipif(not Path("/bin/sh").exists(), reason="no /bin/sh")
def test_a_missing_directory_is_a_clear_125(tmp_path: Path) -> None:
    job = Job(["true"], str(tmp_path / "gone"), {"PATH": "/usr/bin:/bin"})
    _, _, run = _source_job(job, tmp_path)
    done = subprocess.run(["/usr/bin/env", "-i", *run], capture_output=True, check=False)
    assert done.returncode == 125
    assert b"cannot cd to" in done.stderr


@pytest.mark.parametrize("job", [
    Job([], "/", {}),
    Job(["x"], "/", {}, ["relative"]),
    Job(["x"], "/", {}, ["/"]),
    Job(["x"], "/", {}, [], "v3"),  # type: ignore[arg-type]
])
def test_render_job_refuses_bad_jobs(job: Job) -> None:
    with pytest.raises(ValueError):
        render_job(job)


@pytest.mark.skipif(shutil.which("busybox") is None, reason="busybox-static missing")
def test_busybox_has_the_applets_init_uses() -> None:
    from vmfork.testhost.initramfs import _APPLETS
    listed = set(subprocess.run(["busybox", "--list"], capture_output=True, text=True,
                                check=True).stdout.split())
    assert set(_APPLETS) <= listed
