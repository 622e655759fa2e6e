"""Walls a process raises around itself before it runs candidate code: Landlock, seccomp, rlimits.

Everything here is applied by the process to itself (after the fork, before the candidate is
imported) and is inherited by everything it starts; none of it can be undone from inside.

- **Landlock** (Linux 5.13+, unprivileged): the filesystem becomes an allow-list (read the
  system and the Python environment, write only the process's own scratch directory and, for a
  build, its build directory); on ABI 4+ TCP bind/connect are refused; on ABI 6+ signals and
  abstract unix sockets cannot reach a process outside the domain. A Landlock domain also
  refuses ptrace of any process outside it, and so reading another process's
  `/proc/<pid>/environ` or `mem`.
- **seccomp**: a small deny-list filter (ptrace, process_vm_*, mount and namespace calls,
  keyrings, bpf, kernel modules, internet sockets, pidfd signals, and signals to the evaluator's
  own processes or to every process at once). Denied calls fail with EPERM: the candidate sees an
  error, the evaluator sees a verdict.
- **rlimits**: data segment (the memory limit: it counts heap and private mappings, but not the
  large address-space reservations CUDA makes, which `RLIMIT_AS` would break), file size, core
  dumps, and processes (effective for a non-root user; root is exempt by the kernel, so the
  sandbox adds a cgroup where it can).

The syscall numbers are those of x86_64 and aarch64; elsewhere seccomp is reported unavailable.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import struct
from collections.abc import Iterable
from dataclasses import dataclass

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_PR_SET_DUMPABLE = 4
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_SECCOMP_MODE_FILTER = 2
_PR_CAPBSET_DROP = 24
_PR_SET_SECUREBITS = 28
_SECUREBITS_LOCKED_NOROOT = 0x2F  # NOROOT and NO_SETUID_FIXUP, with their locks
_CAPABILITY_VERSION_3 = 0x20080522
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}

_LANDLOCK_CREATE_RULESET = 444
_LANDLOCK_ADD_RULE = 445
_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1

# Filesystem rights by ABI version.
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1

_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
_WRITE = (
    FS_WRITE_FILE
    | FS_REMOVE_DIR
    | FS_REMOVE_FILE
    | FS_MAKE_DIR
    | FS_MAKE_REG
    | FS_MAKE_SOCK
    | FS_MAKE_FIFO
    | FS_MAKE_SYM
    | FS_REFER
    | FS_TRUNCATE
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int


class ConfinementError(OSError):
    """A wall that was asked for could not be raised: the process must not go on."""


def _fail(what: str) -> ConfinementError:
    code = ctypes.get_errno()
    return ConfinementError(code, f"{what}: {os.strerror(code)}")


# ---------------------------------------------------------------- detection


def landlock_abi() -> int:
    """The Landlock ABI version this kernel offers; 0 when Landlock is absent or disabled."""
    value = _libc.syscall(
        _LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), _LANDLOCK_CREATE_RULESET_VERSION
    )
    return int(value) if value > 0 else 0


def seccomp_available() -> bool:
    """Whether this architecture has a filter here and the kernel takes seccomp filters."""
    if _SYSCALLS.get(platform.machine()) is None:
        return False
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            return any(line.startswith("Seccomp:") for line in handle)
    except OSError:
        return False


# ---------------------------------------------------------------- small prctl helpers


def no_new_privileges() -> None:
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise _fail("prctl(PR_SET_NO_NEW_PRIVS)")


def not_dumpable() -> None:
    """No core dumps, and /proc/<pid>/mem, environ and ptrace closed to same-user processes."""
    _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def die_with_parent() -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)


def child_subreaper() -> None:
    """Orphaned descendants are re-parented to this process (so it can find and end them)."""
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def drop_capabilities() -> None:
    """No capabilities, now or after an exec: a root-owned sandbox process is then an ordinary
    process (no raw devices, no reading past permissions, no raising its own limits)."""
    # Securebits and the bounding set need CAP_SETPCAP, so they go first; without capabilities
    # (an ordinary user) both fail harmlessly and there is nothing to drop.
    _libc.prctl(_PR_SET_SECUREBITS, _SECUREBITS_LOCKED_NOROOT, 0, 0, 0)
    for cap in range(64):
        _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    header = struct.pack("Ii", _CAPABILITY_VERSION_3, 0)
    data = b"\0" * 24  # two empty __user_cap_data_struct
    if _libc.syscall(_SYS_CAPSET.get(platform.machine(), -1), header, data) != 0:
        raise _fail("capset")


# ---------------------------------------------------------------- rlimits


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed process; None leaves a limit as it is."""

    memory_bytes: int | None = None
    file_bytes: int | None = None
    processes: int | None = None


def apply_limits(limits: Limits) -> None:
    def lower(kind: int, value: int) -> None:
        _soft, hard = resource.getrlimit(kind)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(kind, (value, value))

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits.memory_bytes is not None:
        lower(resource.RLIMIT_DATA, limits.memory_bytes)
    if limits.file_bytes is not None:
        lower(resource.RLIMIT_FSIZE, limits.file_bytes)
    if limits.processes is not None:
        lower(resource.RLIMIT_NPROC, limits.processes)


# ---------------------------------------------------------------- Landlock


def _handled_fs(abi: int) -> int:
    rights = _READ | _WRITE | FS_MAKE_CHAR | FS_MAKE_BLOCK
    if abi < 2:
        rights &= ~FS_REFER
    if abi < 3:
        rights &= ~FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


def apply_landlock(
    read: Iterable[str],
    write: Iterable[str],
    devices: Iterable[str] = (),
    *,
    scopes: bool = True,
    net: bool = True,
) -> int:
    """Restrict this process (and its descendants) to reading `read`, reading and writing
    `write`, and using the device nodes under `devices`. Paths that do not exist are skipped.
    Returns the ABI used; raises ConfinementError when Landlock is unavailable."""
    abi = landlock_abi()
    if abi <= 0:
        raise ConfinementError(errno.ENOSYS, "Landlock is not available on this kernel")
    handled = _handled_fs(abi)
    handled_net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 and net else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 and scopes else 0
    if abi >= 6:
        attr = struct.pack("QQQ", handled, handled_net, scoped)
    elif abi >= 4:
        attr = struct.pack("QQ", handled, handled_net)
    else:
        attr = struct.pack("Q", handled)
    buffer = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _libc.syscall(_LANDLOCK_CREATE_RULESET, buffer, ctypes.c_size_t(len(attr)), 0)
    if ruleset < 0:
        raise _fail("landlock_create_ruleset")
    try:
        device_rights = _READ | FS_WRITE_FILE | (FS_IOCTL_DEV if abi >= 5 else 0)
        for paths, rights in ((read, _READ), (write, _READ | _WRITE), (devices, device_rights)):
            for path in paths:
                _add_path_rule(int(ruleset), path, rights & handled)
        no_new_privileges()
        if _libc.syscall(_LANDLOCK_RESTRICT_SELF, ctypes.c_int(int(ruleset)), 0) != 0:
            raise _fail("landlock_restrict_self")
    finally:
        os.close(int(ruleset))
    return abi


def _add_path_rule(ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not os.path.isdir(path):
            rights &= _FILE_RIGHTS
        attr = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
        if (
            _libc.syscall(_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), _LANDLOCK_RULE_PATH_BENEATH, attr, 0)
            != 0
        ):
            raise _fail(f"landlock_add_rule({path})")
    finally:
        os.close(fd)


# ---------------------------------------------------------------- seccomp

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000

# name -> (x86_64, aarch64)
_TABLE = {
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "unshare": (272, 97),
    "setns": (308, 268),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "userfaultfd": (323, 282),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "acct": (163, 89),
    "open_by_handle_at": (304, 265),
    "pidfd_open": (434, 434),
    "pidfd_send_signal": (424, 424),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "socket": (41, 198),
    "kill": (62, 129),
    "tkill": (200, 130),
    "tgkill": (234, 131),
    "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240),
}
_SYSCALLS = {
    machine: {name: numbers[column] for name, numbers in _TABLE.items()}
    for column, machine in enumerate(("x86_64", "aarch64"))
}
DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "userfaultfd",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "open_by_handle_at",
    "pidfd_open",
    "pidfd_send_signal",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
)
_DENIED_FAMILIES = (2, 10, 17)  # AF_INET, AF_INET6, AF_PACKET
_SIGNALS = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")

_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_ALLOW = 0x7FFF0000
_EPERM = 0x00050000 | errno.EPERM


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def seccomp_program(protected_pids: Iterable[int] = ()) -> bytes:
    """The BPF filter: the deny-list above, internet sockets, and signals aimed at every
    process (pid -1) or at one of `protected_pids` (the evaluator's own processes)."""
    machine = platform.machine()
    numbers = _SYSCALLS.get(machine)
    if numbers is None:
        raise ConfinementError(errno.ENOSYS, f"no seccomp filter for {machine}")
    protected = sorted({p for p in protected_pids if p > 0})
    out: list[bytes] = [
        _insn(_LD_W_ABS, 0, 0, 4),  # arch
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH[machine]),
        _insn(_RET_K, 0, 0, _EPERM),  # another ABI (i386 via int 0x80): refused
        _insn(_LD_W_ABS, 0, 0, 0),  # syscall number
    ]
    if machine == "x86_64":
        out += [_insn(_JGE_K, 0, 1, _X32_BIT), _insn(_RET_K, 0, 0, _EPERM)]
    for name in DENIED:
        out += [_insn(_JEQ_K, 0, 1, numbers[name]), _insn(_RET_K, 0, 0, _EPERM)]
    # socket(family, ...): internet and packet sockets refused.
    families = list(_DENIED_FAMILIES)
    out += [_insn(_JEQ_K, 0, 2 + len(families) + 1, numbers["socket"]), _insn(_LD_W_ABS, 0, 0, 16)]
    for index, family in enumerate(families):
        out.append(_insn(_JEQ_K, len(families) - index, 0, family))
    out += [_insn(_RET_K, 0, 0, _ALLOW), _insn(_RET_K, 0, 0, _EPERM)]
    # signals: pid/tgid is the first argument; -1, the protected pids and their process groups
    # (negative pids) are refused.
    targets = [0xFFFFFFFF, *protected, *((-pid) & 0xFFFFFFFF for pid in protected)]
    for name in _SIGNALS:
        out += [_insn(_JEQ_K, 0, 1 + len(targets) + 2, numbers[name]), _insn(_LD_W_ABS, 0, 0, 16)]
        for index, pid in enumerate(targets):
            out.append(_insn(_JEQ_K, len(targets) - index, 0, pid))
        out += [_insn(_RET_K, 0, 0, _ALLOW), _insn(_RET_K, 0, 0, _EPERM)]
    out.append(_insn(_RET_K, 0, 0, _ALLOW))
    return b"".join(out)


def apply_seccomp(protected_pids: Iterable[int] = ()) -> None:
    program = seccomp_program(protected_pids)
    count = len(program) // 8
    filters = ctypes.create_string_buffer(program, len(program))

    class _Prog(ctypes.Structure):
        _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))

    prog = _Prog(count, ctypes.cast(filters, ctypes.c_void_p))
    no_new_privileges()
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise _fail("prctl(PR_SET_SECCOMP)")
