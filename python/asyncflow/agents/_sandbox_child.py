"""The sandbox's launcher, run as ``python -I -S _sandbox_child.py SETTINGS`` with the code on
stdin. Standard library only, so it starts fast.

Three processes, so that the code cannot reach the caller:

- the *launcher* (this process, outside) makes new network, PID and mount namespaces (with a user
  namespace when not root), forks the *init* and, once the init reports, ends with the code's own
  exit status (the same signal when the code was killed by one);
- the *init* is PID 1 of the new PID namespace: it mounts a fresh ``/proc`` (only the sandbox's
  processes are visible), makes every mount read-only but the working directory, forks the
  code, reaps whatever the code leaves, and reports the code's wait status. When it ends, the
  kernel kills every process left in the namespace, including those that left the process group
  with ``setsid``;
- the *code* process sets the limits, drops root (as root, to a user id of its own), writes the
  ``sandbox:net=N,pid=N,fs=N`` header line and runs the code. It cannot run as PID 1: the kernel
  does not deliver SIGXCPU (the CPU limit) to a namespace's init.
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import traceback

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 0x1000, 0x4000, 0x40000
SYS_MOUNT_SETATTR = 442  # the same number on every architecture
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 1
#: Files and directories the code may make in its working directory (as root, where it is a
#: tmpfs of its own).
DISK_INODES = 8192
#: Descriptors the code may hold open at once.
OPEN_FILES = 256
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
#: As root, the code runs as ``UID_BASE`` plus the launcher's PID: a user id of its own among the
#: sandboxes running at once (PIDs of live processes are distinct), owning no file, whose
#: ``RLIMIT_NPROC`` counts only its own processes.
UID_BASE = 0x40000000
#: Imported before dropping root: the interpreter's files may be unreadable to the code's user (a
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

libc = ctypes.CDLL(None, use_errno=True)


def unshare(flags: int) -> bool:
    try:
        return bool(libc.unshare(flags) == 0)
    except OSError:
        return False


def isolate() -> tuple[bool, bool, bool]:
    """Leaves the caller's network, PID, mount and System V IPC namespaces where it can;
    ``(network, pid, ipc)``. A fresh network namespace holds only a loopback device that is
    down: no connection leaves it; a fresh IPC namespace's shared memory goes with its last
    process. Without root, a user namespace grants the right to make the others (where
    allowed)."""
    user = 0 if os.geteuid() == 0 else CLONE_NEWUSER
    for others, pid in ((CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS, True), (CLONE_NEWNET, False)):
        for ipc in (CLONE_NEWIPC, 0):  # where it can be made
            if unshare(user | others | ipc):
                return True, pid, bool(ipc)
    return False, False, False


def limit_ipc(memory: int) -> None:
    """Caps System V IPC in the IPC namespace made for the sandbox (never the host's: called
    only when one was made), before its ``/proc`` turns read-only: the namespace's defaults let
    shared memory segments and message queues, which no process's address space counts, hold
    far more than the memory limit. Shared memory is held to ``memory`` bytes in all. Without
    root the writes are refused (the user namespace maps no user), and nothing is capped."""
    page = os.sysconf("SC_PAGE_SIZE")
    limits = {"shmmax": memory, "shmall": max(1, memory // page), "shmmni": 16, "msgmni": 16}
    for name, value in limits.items():
        with contextlib.suppress(OSError), open(f"/proc/sys/kernel/{name}", "w") as f:  # noqa: PTH123
            f.write(str(value))


class MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("set", "clear", "propagation", "userns")]


def set_read_only(path: bytes, read_only: bool, flags: int = 0) -> bool:
    """``mount_setattr(2)`` (Linux 5.12): the mount at ``path`` made read-only or writable."""
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0) if read_only else MountAttr(0, MOUNT_ATTR_RDONLY)
    return bool(
        libc.syscall(
            SYS_MOUNT_SETATTR,
            ctypes.c_int(AT_FDCWD),
            path,
            ctypes.c_uint(flags),
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        )
        == 0
    )


def mount_namespace(disk: int) -> tuple[bool, bool]:
    """Inside the new mount namespace: its mounts made private first (else a mount here could
    reach the host's through shared propagation), then a ``/proc`` of the new PID namespace, then
    a mount of its own over the working directory, then every mount read-only but that one. As
    root the working directory becomes a tmpfs of ``disk`` bytes (the code's files count against
    it, however many); without root it is bound onto itself (a tmpfs made in a user namespace
    that maps no user id takes no new file). Whether the files outside the working directory
    were made read-only, and whether the working directory's size is capped."""
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False, False
    libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    here = os.getcwdb()  # noqa: PTH109 (bytes for libc; no pathlib import in the launcher)
    options = f"size={disk},nr_inodes={DISK_INODES},mode=0777".encode()
    tmpfs = MS_NOSUID | MS_NODEV
    capped = os.geteuid() == 0 and libc.mount(b"tmpfs", here, b"tmpfs", tmpfs, options) == 0
    if not capped and libc.mount(here, here, None, MS_BIND, None) != 0:
        return False, False
    os.chdir(here)  # the working directory held the mount beneath the new one
    return set_read_only(b"/", True, AT_RECURSIVE) and set_read_only(here, False), capped


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]


def drop_capabilities() -> None:
    """Empties this process's capability sets (``capset(2)``, version 3: two words each)."""
    libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), (CapData * 2)())


class SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


#: ``(AUDIT_ARCH_*, socket(2)'s number)`` by machine.
SOCKET_SYSCALL = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, EACCES, AF_UNIX = 0x7FFF0000, 0x00050000, 13, 1


def refuse_unix_sockets() -> bool:
    """A seccomp filter that fails ``socket(AF_UNIX, ...)`` with EACCES: the read-only mounts
    do not stop a ``connect(2)`` to a Unix socket of the host's that the code can see (under
    ``/run`` or ``/tmp``). Also refused, as ways around it: the other ABIs' system calls (i386's
    ``int 0x80``, x32, AArch32), which the filter would not read, and io_uring (425-427 on both
    machines), whose requests make sockets without ``socket(2)``. Returns whether it is in place
    (on a machine it knows)."""
    arch, socket_nr = SOCKET_SYSCALL.get(os.uname().machine, (0, 0))
    if not arch:
        return False
    program = [  # offsets in seccomp_data: nr 0, arch 4, args[0] 16 (its low word)
        (BPF_LD_W_ABS, 0, 0, 4),
        (BPF_JEQ_K, 0, 7, arch),  # 1: another ABI: refused (9)
        (BPF_LD_W_ABS, 0, 0, 0),
        (BPF_JGE_K, 5, 0, 0x40000000),  # 3: x32: refused (9)
        (BPF_JGE_K, 0, 1, 425),  # 4: below io_uring: on (6)
        (BPF_JGE_K, 0, 3, 428),  # 5: io_uring_setup, _enter, _register: refused (9)
        (BPF_JEQ_K, 0, 3, socket_nr),  # 6: not socket(2): allowed (10)
        (BPF_LD_W_ABS, 0, 0, 16),
        (BPF_JEQ_K, 0, 1, AF_UNIX),  # 8: AF_UNIX refused (9), any other allowed (10)
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EACCES),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]
    filters = (SockFilter * len(program))(*(SockFilter(*op) for op in program))
    prog = SockFprog(len(program), filters)
    return bool(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0)


def counts_per_namespace() -> bool:
    """Whether ``RLIMIT_NPROC`` counts a user's processes in each user namespace apart (Linux
    5.14 and later); before, it counted all of the user's processes, outside the sandbox too."""
    release = os.uname().release.split(".")
    try:
        return (int(release[0]), int(release[1].split("-")[0])) >= (5, 14)
    except (IndexError, ValueError):
        return False


def limit(kind: int, value: int, slack: int = 0) -> None:
    """Soft limit ``value``, hard limit ``value + slack``, both held to the hard limit the
    launcher was given: only a privileged process may raise it (a site's cap on processes or
    files would otherwise fail every run)."""
    soft, top = value, value + slack
    hard = resource.getrlimit(kind)[1]
    if hard != resource.RLIM_INFINITY:
        soft, top = min(soft, hard), min(top, hard)
    resource.setrlimit(kind, (soft, top))


def run_code(code: str, settings: dict[str, int], header: str) -> int:
    """Sets the limits, drops root and runs the code; its exit status."""
    try:
        limit(resource.RLIMIT_CPU, int(settings["cpu"]), 1)  # SIGXCPU at the soft limit, then KILL
        limit(resource.RLIMIT_AS, int(settings["memory"]))
        limit(resource.RLIMIT_FSIZE, int(settings["file"]))
        limit(resource.RLIMIT_CORE, 0)
        # Memory no address space counts: files held open (a memfd each, at most the largest
        # file) and pipes.
        limit(resource.RLIMIT_NOFILE, OPEN_FILES)
        if os.geteuid() == 0:
            for name in PRELOAD:
                with contextlib.suppress(ImportError):
                    __import__(name)
            uid = UID_BASE + int(settings["launcher"])
            # Its working directory, made open to any user id, becomes its own alone: the code
            # of other sandboxes running at once cannot read its files.
            os.chown(".", uid, uid)
            os.chmod(".", 0o700)  # noqa: PTH101 (no pathlib import in the launcher)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)  # from root: every capability goes too
            limit(resource.RLIMIT_NPROC, int(settings["processes"]))
        elif settings["userns"] and counts_per_namespace():
            # In the user namespace made for the sandbox the cap counts the processes of this
            # namespace alone, the launcher's two (outside and init) among them.
            limit(resource.RLIMIT_NPROC, int(settings["processes"]) + 2)
        # Without root, the user namespace made for the sandbox gave this process every
        # capability over the sandbox's namespaces (it could unmount its /proc): dropped.
        drop_capabilities()
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # and no program it runs gains any
        refuse_unix_sockets()
        sys.stdout.write(header)
        sys.stdout.flush()
        # Line by line to the pipe (-I ignores PYTHONUNBUFFERED): what the code printed before
        # a kill at the wall-clock or CPU limit is kept.
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.argv = ["<tool>"]
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return (e.code or 0) & 0xFF
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # the code's traceback, without this launcher's frame
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        return 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()


def init(code: str, settings: dict[str, int], isolated: str, report: int) -> None:
    """PID 1 of the sandbox (or a plain child where no PID namespace could be made)."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the launcher killed: so is the sandbox
    if settings["ipc"]:
        limit_ipc(int(settings["memory"]))
    files, disk = mount_namespace(int(settings["disk"])) if os.getpid() == 1 else (False, False)
    child = os.fork()
    if child == 0:
        os.close(report)
        header = f"sandbox:{isolated},fs={int(files)},disk={int(disk)}\n"
        os._exit(run_code(code, settings, header))
    while True:  # reap orphans too, until the code itself ends
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            break
    os.write(report, str(status).encode())


def main() -> None:
    settings = json.loads(sys.argv[1])
    code = sys.stdin.read()
    settings["launcher"] = os.getpid()
    root = os.geteuid() == 0
    network, pid, settings["ipc"] = isolate()
    settings["userns"] = network and not root  # (every namespace comes with a user one)
    isolated = f"net={int(network)},pid={int(pid)}"
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(read)
            init(code, settings, isolated, write)
            os._exit(0)
        except BaseException:  # a launcher failure, not the code's: reported as one
            traceback.print_exc()
            os._exit(70)
    os.close(write)
    _, init_status = os.waitpid(child, 0)
    with os.fdopen(read, "rb") as f:
        reported = f.read()
    status = int(reported) if reported else init_status
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set, nor need be
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


main()
