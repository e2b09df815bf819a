"""Keeping the suite on 127.0.0.0/8: the name wrapper every child process loads, and an strace audit of a command.

``install()`` (called by the root conftest before any test starts a process) builds ``loopback_names.c`` once per
run and puts it in ``LD_PRELOAD``, so torch.distributed's stores name their loopback peers without a DNS query (see
the C file for why glibc would ask one). ``traced(cmd, log)`` runs a command under ``strace -f`` and
``outside(log text)`` lists every connect/sendto target outside loopback, for the test that holds the promise and
for auditing a whole test folder by hand: ``python -m netguard python -m pytest cluster``, from ``tests/``."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("loopback_names.c")
#: the environment variable naming the built wrapper (empty when it could not be built)
ENV = "STREAMBATCH_TESTS_NAME_WRAPPER"


def install() -> str | None:
    """Build the wrapper into a folder of this run and prepend it to ``LD_PRELOAD`` for this process's children;
    the path, or None where no C compiler is found (Linux only)."""
    if os.environ.get(ENV) is not None:  # a nested run (a test running pytest) inherits the parent's
        return os.environ[ENV] or None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not sys.platform.startswith("linux") or cc is None:
        os.environ[ENV] = ""
        return None
    folder = Path(tempfile.mkdtemp(prefix="streambatch-tests-netguard-"))
    atexit.register(shutil.rmtree, folder, True)
    out = folder / "loopback_names.so"
    done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(SOURCE), "-ldl"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        os.environ[ENV] = ""
        return None
    # readable by every user: some tests run a command as another user (permission checks), and ld.so refuses a
    # preload it cannot open with a line on stderr
    folder.chmod(0o755)
    out.chmod(0o755)
    preload = os.environ.get("LD_PRELOAD", "")
    os.environ["LD_PRELOAD"] = f"{out} {preload}".strip()
    os.environ[ENV] = str(out)
    return str(out)


_ADDR = re.compile(r'sa_family=AF_INET6?, sin6?_port=htons\((\d+)\), (?:sin_addr=inet_addr\("([^"]+)"\)'
                   r'|sin6_flowinfo=[^,]+, inet_pton\(AF_INET6, "([^"]+)"\))')


def loopback(address: str) -> bool:
    """Whether an address strace printed is in 127.0.0.0/8 (also v4-mapped) or ::1."""
    if address.startswith("::ffff:"):
        address = address[len("::ffff:"):]
    return address.startswith("127.") or address == "::1"


def outside(trace: str) -> list[str]:
    """The strace lines (connect, sendto) whose target is outside loopback. ``0.0.0.0`` and ``::`` count as
    outside: Linux routes them to loopback, but they are not a loopback literal."""
    bad = []
    for line in trace.splitlines():
        if "connect(" not in line and "sendto(" not in line:
            continue
        for m in _ADDR.finditer(line):
            if not loopback(m.group(2) or m.group(3)):
                bad.append(line.strip())
    return bad


def traced(cmd: list[str], log: str | os.PathLike) -> list[str]:
    """``cmd`` under ``strace -f``, logging every connect and sendto (of it and all it starts) to ``log``; read
    the log with :func:`outside`. ``--seccomp-bpf`` stops only at those two calls, so the traced command runs
    at about its usual speed."""
    return ["strace", "-f", "--seccomp-bpf", "-qq", "-e", "trace=connect,sendto", "-o", str(log), *cmd]
