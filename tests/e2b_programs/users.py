"""An E2B program: envd's users, the SDK's ``user=`` on commands and files. Run by the
tests with the SDK's own interpreter:

    python users.py TEMPLATE WORKDIR USER [--home]

USER is a user the sandbox has (the default image's ``user``; on the unit tier's host,
``nobody``). ``--home``: USER's home exists, so also check the defaults that use it
(a command's working directory, relative paths). Prints one JSON object.
"""

import json
import sys
import urllib.parse
import urllib.request

from e2b import Sandbox, SandboxException


def refused(call) -> dict | None:
    try:
        call()
    except SandboxException as err:   # the SDK's own exceptions, named in the output
        return {"type": type(err).__name__, "message": str(err)}
    return None


def main() -> None:
    template, work, user = sys.argv[1], sys.argv[2], sys.argv[3]
    home = "--home" in sys.argv[4:]
    seen: dict = {}
    sandbox = Sandbox.create(template=template)
    try:
        sandbox.files.make_dir(work)
        sandbox.commands.run(f"chmod 1777 {work}")
        seen["id"] = sandbox.commands.run("id -un; id -u; echo $HOME $USER", user=user,
                                          cwd="/").stdout
        seen["root_id"] = sandbox.commands.run("id -un", user="root", cwd="/").stdout
        seen["default_id"] = sandbox.commands.run("id -u", cwd="/").stdout
        background = sandbox.commands.run("id -u; sleep 0.2", user=user, cwd="/",
                                          background=True)
        seen["background_id"] = background.wait().stdout
        sandbox.files.write(f"{work}/by-user.txt", "mine", user=user)
        sandbox.files.make_dir(f"{work}/made/by/user", user=user)
        owner = "stat -c %u:%g "
        seen["file_owner"] = sandbox.commands.run(owner + f"{work}/by-user.txt").stdout
        seen["dir_owners"] = sandbox.commands.run(
            owner + f"{work}/made {work}/made/by {work}/made/by/user").stdout
        sandbox.files.write(f"{work}/by-root.txt", "root's", user="root")
        seen["root_file_owner"] = sandbox.commands.run(owner + f"{work}/by-root.txt").stdout
        # No user: the sandbox's default (E2B's templates: ``user``).
        sandbox.files.write(f"{work}/by-default.txt", "default's")
        seen["default_file_owner"] = sandbox.commands.run(
            owner + f"{work}/by-default.txt").stdout
        seen["default_pwd"] = sandbox.commands.run("pwd").stdout
        seen["read_back"] = sandbox.files.read(f"{work}/by-user.txt", user=user)
        # A signed upload URL for the user: the file it writes is the user's.
        url = sandbox.upload_url(f"{work}/uploaded-by-user.txt", user=user)
        boundary = "users-test"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                f"filename=\"uploaded-by-user.txt\"\r\n\r\nup\r\n--{boundary}--\r\n").encode()
        request = urllib.request.Request(url, data=body, method="POST", headers={
            "Content-Type": f"multipart/form-data; boundary={boundary}",
            "E2b-Sandbox-Id": sandbox.sandbox_id})
        with urllib.request.urlopen(request, timeout=60) as r:
            seen["upload_status"] = r.status
        seen["upload_owner"] = sandbox.commands.run(
            owner + f"{work}/uploaded-by-user.txt").stdout
        if home:
            seen["home_pwd"] = sandbox.commands.run("pwd", user=user).stdout
            sandbox.files.write("relative.txt", "in my home", user=user)
            seen["relative"] = sandbox.commands.run(
                f"cat ~{user}/relative.txt; echo; stat -c %U ~{user}/relative.txt").stdout
            seen["relative_read"] = sandbox.files.read("relative.txt", user=user)
            seen["root_relative"] = sandbox.commands.run("pwd", user="root").stdout
        seen["unknown_run"] = refused(
            lambda: sandbox.commands.run("true", user="no-such-user", cwd="/"))
        seen["unknown_write"] = refused(
            lambda: sandbox.files.write(f"{work}/never.txt", "x", user="no-such-user"))
        seen["never_written"] = sandbox.files.exists(f"{work}/never.txt")
        query = urllib.parse.urlsplit(url).query
        seen["upload_url_user"] = dict(urllib.parse.parse_qsl(query)).get("username")
    finally:
        sandbox.kill()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
