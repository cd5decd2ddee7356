"""The sandbox's launcher, run as ``python -I -S _sandbox_child.py SETTINGS`` with the code on
stdin: it leaves the network, sets the limits, drops root, writes ``net:0``/``net:1`` as its
first line of output, then runs the code. Standard library only, so it starts fast."""

import contextlib
import ctypes
import json
import os
import resource
import sys
import traceback

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
NOBODY = 65534
#: Imported before dropping root: the interpreter's files may be unreadable to ``nobody`` (a
#: Python under /root), and code that runs in the sandbox mostly wants these.
PRELOAD = (
    "collections",
    "datetime",
    "decimal",
    "fractions",
    "functools",
    "itertools",
    "json",
    "math",
    "random",
    "re",
    "socket",
    "statistics",
    "string",
    "time",
)


def leave_network() -> bool:
    """A fresh network namespace holds only a loopback device that is down: no connection
    leaves it. Without root, a user namespace grants the right to make one (where allowed)."""
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWNET | CLONE_NEWUSER
    try:
        return bool(ctypes.CDLL(None, use_errno=True).unshare(flags) == 0)
    except OSError:
        return False


def limit(kind: int, value: int, slack: int = 0) -> None:
    resource.setrlimit(kind, (value, value + slack))


def main() -> None:
    settings = json.loads(sys.argv[1])
    code = sys.stdin.read()
    isolated = leave_network()
    limit(resource.RLIMIT_CPU, int(settings["cpu"]), 1)  # SIGXCPU at the soft limit, then KILL
    limit(resource.RLIMIT_AS, int(settings["memory"]))
    limit(resource.RLIMIT_FSIZE, int(settings["file"]))
    limit(resource.RLIMIT_CORE, 0)
    if os.geteuid() == 0:
        for name in PRELOAD:
            with contextlib.suppress(ImportError):
                __import__(name)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        limit(resource.RLIMIT_NPROC, int(settings["processes"]))
    sys.stdout.write(f"net:{int(isolated)}\n")
    sys.stdout.flush()
    sys.argv = ["<tool>"]
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
    except SystemExit:
        raise
    except BaseException as e:  # the code's traceback, without this launcher's frame
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        sys.stdout.flush()
        sys.exit(1)


main()
