"""The sandbox every candidate runs in, and the isolation level it reached on this machine.

Levels, weakest first (`IsolationLevel` in core.settings):

- `process`: the candidate runs in a process of its own, apart from the judge, with its
  capabilities dropped, a scrubbed environment, rlimits and a seccomp filter (where the
  architecture has one), but sees the machine's filesystem as its user does.
- `landlock`: the same, and a Landlock domain per candidate: it reads only the system and the
  Python environment, writes only its own scratch directory (and its build directory), cannot
  signal, trace or read the memory of any process outside its domain, and cannot open TCP
  connections.
- `bubblewrap`: the zygote that forks candidates lives in a bubblewrap sandbox: its own mount
  view (the system, Python, torch and the evaluator read-only; a private, size-limited /tmp;
  the build cache; the GPU device files; no store, repository or home), its own PID, network,
  IPC and UTS namespaces, no capabilities, a cleared environment; it dies with the evaluator.
- `bubblewrap+landlock`: both; the strongest, and what `auto` picks where the machine has
  bwrap and Landlock.

`detect()` finds what the machine offers (bwrap on PATH or `KERNELFLEET_BWRAP`, a test run of
it, the Landlock ABI, seccomp) and says why anything is missing; every result records the
level in force for its candidate, and `min_isolation` refuses to run below a level.

One zygote serves every evaluator of a process with the same sandbox settings: it pays the
torch import once, and each candidate is a fork (tens of milliseconds), confined on its own.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import glob
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kernelfleet.core.errors import UsageError
from kernelfleet.core.settings import ISOLATION_LEVELS, isolation_rank
from kernelfleet.evaluator import _confine
from kernelfleet.evaluator._wire import Channel, ChannelClosed, PacketChannel, ProtocolError

_SAFE_ENV = (
    "LANG",
    "LC_ALL",
    "TZ",
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_MODULE_LOADING",
    "LD_LIBRARY_PATH",
    "NVIDIA_DRIVER_CAPABILITIES",
    "TORCH_CUDA_ARCH_LIST",
    "TRITON_PTXAS_PATH",
    "CC",
    "CXX",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)
_SYSTEM_DIRS = ("/usr", "/etc", "/opt")
_TOP_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEFAULT_TMP_BYTES = 4 * 1024**3


def slot_dirs(slots: int) -> list[str]:
    """The sandbox's scratch slots: one tmpfs of its own for each process that runs at once,
    so that what one writes never takes another's space."""
    return [f"/tmp/kf-slot-{index}" for index in range(slots)]


# ---------------------------------------------------------------- detection


@dataclasses.dataclass(frozen=True)
class IsolationReport:
    """What this machine offers for sandboxing, and the strongest level it reaches."""

    level: str
    bwrap: str | None
    bwrap_problem: str
    landlock_abi: int
    seccomp: bool
    cgroup: str | None

    def describe(self) -> str:
        parts = [f"isolation level: {self.level}"]
        parts.append(f"bubblewrap: {self.bwrap}" if self.bwrap else f"bubblewrap: no ({self.bwrap_problem})")
        parts.append(
            f"landlock: ABI {self.landlock_abi}"
            + (" (signals and abstract sockets scoped)" if self.landlock_abi >= 6 else "")
            if self.landlock_abi
            else "landlock: not available on this kernel"
        )
        parts.append("seccomp: yes" if self.seccomp else "seccomp: not available")
        parts.append(f"process limit: cgroup {self.cgroup}" if self.cgroup else "process limit: RLIMIT_NPROC")
        return "\n".join(parts)


def _bwrap_path() -> str | None:
    explicit = os.environ.get("KERNELFLEET_BWRAP")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("bwrap")


@functools.cache
def detect() -> IsolationReport:
    """Probe the machine once per process."""
    abi = _confine.landlock_abi()
    seccomp = _confine.seccomp_available()
    bwrap = _bwrap_path()
    problem = ""
    if bwrap is None:
        problem = "bwrap is not installed (apt-get install bubblewrap), or set KERNELFLEET_BWRAP"
    else:
        problem = _try_bwrap(bwrap)
        if problem:
            bwrap = None
    level = ("bubblewrap" if bwrap else "process") + ("+landlock" if bwrap and abi else "")
    if not bwrap and abi:
        level = "landlock"
    return IsolationReport(level, bwrap, problem, abi, seccomp, _cgroup_root())


def _try_bwrap(bwrap: str) -> str:
    """'' when bwrap builds our sandbox here; else what went wrong."""
    argv = _bwrap_argv(bwrap, build_root=None, tmp_bytes=64 * 1024**2, control_fd=None, slots=1)
    argv += [sys.executable, "-S", "-c", "pass"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        return f"bwrap could not run: {error}"
    if done.returncode != 0:
        return f"bwrap failed here: {done.stderr.strip()[-300:] or f'status {done.returncode}'}"
    return ""


def _cgroup_root() -> str | None:
    """A cgroup directory where a pids limit can be set (root on this machine), else None."""
    for candidate in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        if os.path.exists(os.path.join(candidate, "cgroup.procs")) and os.access(candidate, os.W_OK):
            if candidate.endswith("/cgroup"):
                try:
                    controllers = Path(candidate, "cgroup.subtree_control").read_text()
                except OSError:
                    continue
                if "pids" not in controllers.split():
                    continue
            return candidate
    return None


def resolve_level(requested: str, minimum: str | None) -> str:
    """The level to run at: `requested` ('auto': the strongest here), refused (UsageError,
    saying what to install) when it is below `minimum` or not available."""
    report = detect()
    level = report.level if requested == "auto" else requested
    if requested != "auto" and isolation_rank(requested) > isolation_rank(report.level):
        raise UsageError(f"isolation {requested!r} is not available here:\n{report.describe()}")
    if requested != "auto" and "landlock" in requested and not report.landlock_abi:
        raise UsageError(f"isolation {requested!r} needs Landlock:\n{report.describe()}")
    if requested == "bubblewrap" and not report.bwrap:
        raise UsageError(f"isolation 'bubblewrap' needs bwrap:\n{report.describe()}")
    if minimum is not None and isolation_rank(level) < isolation_rank(minimum):
        raise UsageError(
            f"isolation.min_level is {minimum!r}, but this machine reaches {level!r} (levels, weakest first: "
            f"{', '.join(ISOLATION_LEVELS)}); install bubblewrap (apt-get install bubblewrap) or use a "
            f"kernel with Landlock, or lower --isolation-min-level\n{report.describe()}"
        )
    return level


# ---------------------------------------------------------------- the bubblewrap command


def _import_entries() -> list[str]:
    """This process's import paths that a candidate may see: not a directory that holds the
    working directory or the home (a repository root put on the path, with its local store in
    it), not the main script's directory (anything may lie beside a script), not /tmp."""
    cwd = os.path.realpath(os.getcwd())
    home = os.path.realpath(os.path.expanduser("~"))
    script = os.path.dirname(os.path.realpath(sys.argv[0])) if sys.argv and sys.argv[0] else ""
    temporary = {os.path.realpath(p) for p in ("/", "/tmp", "/var/tmp", tempfile.gettempdir())}
    kept = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        real = os.path.realpath(entry)
        if any(inner == real or inner.startswith(real.rstrip("/") + "/") for inner in (cwd, home)):
            continue
        if real in temporary or (real == script and not os.path.isdir(os.path.join(real, "kernelfleet"))):
            continue
        kept.append(real)
    return list(dict.fromkeys(kept))


def _python_paths() -> list[str]:
    """What the Python environment needs: the interpreter, its prefixes, and the import paths
    of `_import_entries`."""
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    paths.update(_import_entries())
    for name in ("kernelfleet.core", "kernelfleet.evaluator"):
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None) if module is not None else None
        if file:
            paths.add(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(file)))))
    return _outermost(paths)


def _outermost(paths: Iterable[str]) -> list[str]:
    """Paths not below another in the set, and not below the system directories."""
    ordered = sorted({p.rstrip("/") or "/" for p in paths}, key=len)
    kept: list[str] = []
    for path in ordered:
        if path == "/" or any(path == k or path.startswith(k + "/") for k in (*kept, *_SYSTEM_DIRS)):
            continue
        kept.append(path)
    return kept


def sensitive_paths() -> list[str]:
    """Paths a candidate must never see even when they lie below a bound directory: the
    store's credentials, a local store, the user's home."""
    found = [os.path.expanduser("~")]
    for name in ("KERNELFLEET_S3_CREDENTIALS_DIR", "KERNELFLEET_STORE"):
        value = os.environ.get(name, "")
        if value and "://" not in value:
            found.append(os.path.abspath(value))
    found.append(os.path.abspath(".kernelfleet"))
    return [os.path.realpath(p) for p in found]


def read_paths() -> list[str]:
    """What a confined candidate may read (Landlock): system, Python, devices, /proc, /sys."""
    paths = [*(p for p in _SYSTEM_DIRS if os.path.exists(p)), *_python_paths(), "/proc", "/sys", "/dev"]
    for link in _TOP_LINKS:
        if os.path.exists(link):
            paths.append(link)
    return paths


def _device_files() -> list[str]:
    return sorted(glob.glob("/dev/nvidia*") + glob.glob("/dev/nvidia-caps/*"))


def _import_path() -> str:
    """PYTHONPATH for the zygote: this process's import paths that the sandbox binds (a package
    found only through PYTHONPATH here, like a wheel unpacked into /tmp/site, is found there)."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    # The interpreter finds its own library and site-packages.
    kept = [p for p in _import_entries() if not any(p.startswith(x.rstrip("/") + "/") for x in prefixes)]
    return os.pathsep.join(kept)


def sandbox_env() -> dict[str, str]:
    """The zygote's whole environment: an allow-list, never the caller's credentials."""
    env = {name: os.environ[name] for name in _SAFE_ENV if name in os.environ}
    env["PYTHONPATH"] = _import_path()
    bin_dirs = [
        os.path.join(sys.prefix, "bin"),
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
    ]
    cuda = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    bin_dirs.insert(1, os.path.join(cuda, "bin"))
    env["PATH"] = ":".join(bin_dirs)
    env.setdefault("LANG", "C.UTF-8")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _bwrap_argv(
    bwrap: str, *, build_root: str | None, tmp_bytes: int, control_fd: int | None, slots: int = 0
) -> list[str]:
    """bwrap's command line. Each of `slots` scratch slots is a tmpfs of `tmp_bytes`; `/tmp`,
    where the children beyond the slots keep their scratch (several evaluators sharing one
    sandbox), is one tmpfs sized for all of them, as it was before slots."""
    argv = [
        bwrap,
        "--die-with-parent",
        "--new-session",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--cap-drop",
        "ALL",
    ]
    for directory in _SYSTEM_DIRS:
        if os.path.isdir(directory):
            argv += ["--ro-bind", directory, directory]
    for link in _TOP_LINKS:
        if os.path.islink(link):
            argv += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            argv += ["--ro-bind", link, link]
    argv += ["--proc", "/proc", "--dev", "/dev", "--ro-bind-try", "/sys", "/sys"]
    for device in _device_files():
        argv += ["--dev-bind-try", device, device]
    argv += ["--size", str(tmp_bytes * max(1, slots)), "--tmpfs", "/tmp"]
    for slot in slot_dirs(slots):
        argv += ["--size", str(tmp_bytes), "--tmpfs", slot]
    bound = _python_paths()
    for path in bound:
        argv += ["--ro-bind", path, path]
    if build_root is not None:
        argv += ["--bind", build_root, build_root]
        bound.append(build_root)
    for secret in sensitive_paths():
        if any(secret.startswith(b + "/") for b in [*bound, *_SYSTEM_DIRS]) and os.path.isdir(secret):
            argv += ["--tmpfs", secret]  # hidden under an empty directory
    argv += ["--clearenv"]
    for name, value in sandbox_env().items():
        argv += ["--setenv", name, value]
    argv += ["--chdir", "/tmp"]
    if control_fd is not None:
        argv += ["--"]
    return argv


# ---------------------------------------------------------------- the zygote and its children


class SandboxError(RuntimeError):
    """The sandbox itself failed (not a candidate): it could not start, or died."""


@dataclasses.dataclass
class Walls:
    """The walls one child raises around itself (see `_confine`)."""

    landlock: bool = False
    seccomp: bool = False
    memory_bytes: int | None = None
    file_bytes: int | None = None
    processes: int | None = None
    write: tuple[str, ...] = ()
    read: tuple[str, ...] = ()  # beyond `read_paths()`: a candidate's sealed torch.compile cache

    def to_json(self) -> dict[str, Any]:
        return {
            "landlock": self.landlock,
            "seccomp": self.seccomp,
            "read": [*read_paths(), *self.read] if self.landlock else [],
            "write": list(self.write),
            "limits": {
                "memory_bytes": self.memory_bytes,
                "file_bytes": self.file_bytes,
                "processes": self.processes,
            },
        }


class SandboxChild:
    """One forked child: its channel, its log, how it ended."""

    def __init__(self, sandbox: Sandbox, ident: int, channel: Channel, log_path: Path) -> None:
        self.sandbox = sandbox
        self.id = ident
        self.channel = channel
        self.log_path = log_path
        self.scratch = ""
        self.pid = 0
        self.exited = threading.Event()
        self.status: dict[str, int] = {}

    def kill(self) -> None:
        self.sandbox.kill(self)

    def wait(self, timeout: float) -> bool:
        return self.exited.wait(timeout)

    @property
    def exit_description(self) -> str:
        if not self.exited.is_set():
            return "did not exit"
        if "signal" in self.status:
            try:
                name = signal.Signals(self.status["signal"]).name
            except ValueError:
                name = f"signal {self.status['signal']}"
            return f"was killed by {name}"
        if "lost" in self.status:
            return "was lost with its sandbox"
        return f"exited with status {self.status.get('code', '?')}"

    def log_tail(self, limit: int = 6000) -> str:
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(0, os.SEEK_END)
                size = handle.tell()
                handle.seek(max(0, size - limit))
                return handle.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Kill the child if it still runs, wait briefly for its exit, drop its files."""
        if not self.exited.is_set():
            self.kill()
            self.exited.wait(10)
        self.channel.close()
        with contextlib.suppress(OSError):
            self.log_path.unlink()


class Sandbox:
    """A zygote (inside bubblewrap at the bubblewrap levels) and the children it forks."""

    def __init__(
        self,
        level: str,
        *,
        build_root: str,
        tmp_bytes: int = DEFAULT_TMP_BYTES,
        slots: int = 0,
        processes: int = 4096,
    ) -> None:
        if level not in ISOLATION_LEVELS:
            raise UsageError(f"unknown isolation level {level!r}; choose from {', '.join(ISOLATION_LEVELS)}")
        self.level = level
        self.build_root = build_root
        self.tmp_bytes = tmp_bytes  # each slot's size, and /tmp's
        self.slots = slots  # scratch tmpfs mounts, one per child at once (bubblewrap levels only)
        self.processes = processes
        self.host_dir = Path(tempfile.mkdtemp(prefix="kernelfleet-sandbox-"))
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[threading.Event, dict[str, Any]]] = {}
        self._children: dict[int, SandboxChild] = {}
        self._control: PacketChannel | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._cgroup: str | None = None
        self._alive = False
        self._closed = False
        self._compile_ready = False  # the zygote has readied torch.compile (`spawn(compiles=True)`)

    def waits_on(self, compiles: bool) -> str:
        """What a spawn now may wait for besides the fork itself, for the progress: '' or a
        clause (the zygote starting, which imports torch; it readying torch.compile)."""
        if not self._alive:
            return "the sandbox is starting (it imports torch once)"
        if compiles and not self._compile_ready:
            return "the sandbox readies torch.compile for its children (once: inductor's CPU checks)"
        return ""

    @property
    def uses_bwrap(self) -> bool:
        return self.level.startswith("bubblewrap")

    @property
    def uses_landlock(self) -> bool:
        return self.level.endswith("landlock")

    # -- the zygote

    def _ensure(self) -> PacketChannel:
        with self._lock:
            if self._closed:
                raise SandboxError("the sandbox is closed")
            if self._alive and self._control is not None:
                return self._control
            self._start()
            assert self._control is not None
            return self._control

    def _start(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = theirs.fileno()
        command = [sys.executable, "-m", "kernelfleet.evaluator._zygote", str(fd)]
        if self.uses_bwrap:
            bwrap = detect().bwrap
            if bwrap is None:
                raise SandboxError(f"bubblewrap is not usable here: {detect().bwrap_problem}")
            Path(self.build_root).mkdir(parents=True, exist_ok=True)
            argv = _bwrap_argv(
                bwrap, build_root=self.build_root, tmp_bytes=self.tmp_bytes, control_fd=fd, slots=self.slots
            )
            command = argv + command + slot_dirs(self.slots)
        log = open(self.host_dir / "zygote.log", "ab")  # noqa: SIM115 - handed to the child
        result: dict[str, Any] = {}
        started = threading.Event()

        def keeper() -> None:
            # bwrap's --die-with-parent follows the thread that started it: this thread lives
            # as long as the process, so the sandbox dies with the evaluator, not with a worker.
            try:
                result["process"] = subprocess.Popen(
                    command,
                    pass_fds=(fd,),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env=sandbox_env(),
                    cwd=str(self.host_dir),
                    start_new_session=True,
                )
            except OSError as error:
                result["error"] = error
            started.set()
            threading.Event().wait()

        threading.Thread(target=keeper, name="kernelfleet-sandbox", daemon=True).start()
        started.wait()
        log.close()
        theirs.close()
        if "error" in result:
            raise SandboxError(f"cannot start the sandbox: {result['error']}")
        self._process = result["process"]
        control = PacketChannel(mine)
        try:
            ready = control.receive(timeout=600)
        except (ChannelClosed, TimeoutError, ProtocolError) as error:
            with contextlib.suppress(OSError):
                self._process.kill()
            text = (self.host_dir / "zygote.log").read_text(errors="replace")[-3000:]
            raise SandboxError(f"the sandbox did not start ({error}):\n{text}") from None
        if ready.get("op") != "ready":
            raise SandboxError(f"the sandbox answered {ready!r} instead of ready")
        self._limit_processes()
        self._control = control
        self._alive = True
        threading.Thread(
            target=self._reader, args=(control,), name="kernelfleet-sandbox-reader", daemon=True
        ).start()

    def _limit_processes(self) -> None:
        """Put the zygote and everything below it into a cgroup with a pids limit, where this
        user may (root); elsewhere each child's RLIMIT_NPROC does it."""
        root = detect().cgroup
        if root is None or self._process is None:
            return
        path = os.path.join(root, f"kernelfleet-{os.getpid()}-{id(self):x}")
        try:
            os.makedirs(path, exist_ok=True)
            Path(path, "pids.max").write_text(str(self.processes))
            for pid in [self._process.pid, *descendants(self._process.pid)]:
                with contextlib.suppress(OSError):
                    Path(path, "cgroup.procs").write_text(str(pid))
            self._cgroup = path
        except OSError:
            self._cgroup = None

    def _reader(self, control: PacketChannel) -> None:
        while True:
            try:
                message = control.receive()
            except ProtocolError:
                continue
            except (ChannelClosed, OSError):
                break
            op = message.get("op")
            ident = message.get("id")
            if op in ("spawned", "failed") and isinstance(ident, int):
                waiter = self._pending.get(ident)
                if waiter is not None:
                    waiter[1].update(message)
                    waiter[0].set()
            elif op == "exited" and isinstance(ident, int):
                child = self._children.pop(ident, None)
                if child is not None:
                    child.status = {k: int(v) for k, v in message.items() if k in ("code", "signal")}
                    child.exited.set()
        with self._lock:
            if self._control is control:
                self._alive = False
                self._control = None
            lost = list(self._children.values())
            self._children.clear()
            pending = list(self._pending.values())
        for child in lost:
            child.status = {"lost": 1}
            child.exited.set()
        for event, answer in pending:
            answer.setdefault("op", "failed")
            answer.setdefault("error", "the sandbox died")
            event.set()
        with contextlib.suppress(Exception):
            control.close()

    # -- children

    def spawn(self, role: str, walls: Walls, env: dict[str, str], *, compiles: bool = False) -> SandboxChild:
        """Fork one child in the sandbox; it raises `walls` around itself before anything
        else. `compiles`: it will run torch.compile, which the zygote readies once before it
        forks the first such child (that fork waits for it). SandboxError when the sandbox cannot."""
        control = self._ensure()
        ident = next(self._ids)
        channel, theirs = _pair()
        log_path = self.host_dir / f"child-{ident}.log"
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        child = SandboxChild(self, ident, channel, log_path)
        event = threading.Event()
        answer: dict[str, Any] = {}
        with self._lock:
            self._pending[ident] = (event, answer)
            self._children[ident] = child
        request = {
            "op": "spawn",
            "id": ident,
            "role": role,
            "walls": walls.to_json(),
            "env": env,
            "compiles": compiles,
        }
        try:
            with self._lock:
                control.send(request, fds=[theirs.fileno(), log_fd])
        except (ChannelClosed, OSError) as error:
            self._children.pop(ident, None)
            raise SandboxError(f"the sandbox is gone: {error}") from None
        finally:
            theirs.close()
            os.close(log_fd)
        # Readying torch.compile (once per sandbox) may come first: 30 s on 2 busy cores.
        if not event.wait(600):
            raise SandboxError("the sandbox did not fork a child within 600 s")
        self._pending.pop(ident, None)
        if answer.get("op") != "spawned":
            self._children.pop(ident, None)
            raise SandboxError(f"the sandbox could not fork: {answer.get('error')}")
        child.pid = int(answer.get("pid", 0))
        child.scratch = str(answer.get("scratch", ""))
        self._compile_ready = self._compile_ready or compiles
        return child

    def kill(self, child: SandboxChild) -> None:
        with self._lock:
            control = self._control if self._alive else None
            if control is None:
                return
            with contextlib.suppress(ChannelClosed, OSError):
                control.send({"op": "kill", "id": child.id})

    def close(self) -> None:
        self.hang_up()
        self.reap()

    def hang_up(self) -> None:
        """Tell the zygote to end: it kills its children and exits when its control socket
        ends (`reap` waits for that). The sandbox cannot be used afterwards."""
        with self._lock:
            self._closed = True
            control, self._control = self._control, None
        if control is not None:
            control.hang_up()  # the reader thread is blocked receiving on it: a close alone is no end

    def reap(self) -> None:
        """Wait for the zygote that `hang_up` ended (killing it after 10 s), then remove what
        the sandbox kept on the host."""
        with self._lock:
            process = self._process
        if process is not None:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(5)
        if self._cgroup:
            for _ in range(50):
                try:
                    os.rmdir(self._cgroup)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy until the kernel has let go of the zygote's last process
                    time.sleep(0.1)
        shutil.rmtree(self.host_dir, ignore_errors=True)


def _pair() -> tuple[Channel, socket.socket]:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Channel(mine), theirs


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (empty where it cannot be read)."""
    found: list[int] = []
    queue = [pid]
    while queue:
        current = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{current}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in children:
                found.append(int(child))
                queue.append(int(child))
    return found


def alive(pids: Iterable[int]) -> list[int]:
    """Those of `pids` that still run (a zombie, ended but not yet reaped, does not)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            running.append(pid)
    return running


def host_pid(sandbox: Sandbox, child: SandboxChild) -> int:
    """The child's pid as this process sees it (0 if not found): the zygote reports pids of
    its own PID namespace, which inside bubblewrap differ from ours."""
    if not sandbox.uses_bwrap:
        return child.pid
    process = sandbox._process
    if process is None:
        return 0
    for pid in descendants(process.pid):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("NSpid:") and line.split()[-1] == str(child.pid):
                    return pid
        except OSError:
            continue
    return 0


# ---------------------------------------------------------------- one sandbox per setting

_SANDBOXES: dict[tuple[str, str, int, int], Sandbox] = {}
_SANDBOXES_LOCK = threading.Lock()


def sandbox_for(level: str, build_root: str, tmp_bytes: int = DEFAULT_TMP_BYTES, slots: int = 0) -> Sandbox:
    """The process's shared sandbox for these settings (started on first use)."""
    key = (level, build_root, tmp_bytes, slots)
    with _SANDBOXES_LOCK:
        sandbox = _SANDBOXES.get(key)
        if sandbox is None or sandbox._closed:
            sandbox = Sandbox(level, build_root=build_root, tmp_bytes=tmp_bytes, slots=slots)
            _SANDBOXES[key] = sandbox
        return sandbox


@atexit.register
def close_all() -> None:
    with _SANDBOXES_LOCK:
        sandboxes = list(_SANDBOXES.values())
        _SANDBOXES.clear()
    for sandbox in sandboxes:  # every zygote ends at once, not one after another
        sandbox.hang_up()
    for sandbox in sandboxes:
        sandbox.reap()
