"""The sandbox's zygote: a torch-preloaded process that forks one confined child per job.

Started by `_sandbox.Sandbox` (inside bubblewrap when the machine has it), it imports torch
and the evaluator's child code once, then waits on its control socket. Each `spawn` request
brings two file descriptors (the child's channel to the evaluator and its log file); the
zygote forks, and the child raises its walls (its own process group, rlimits, Landlock,
seccomp) before it reads a line of candidate code. The zygote never touches CUDA and never
runs candidate code itself.

It is the reaper of everything below it: when a child exits its whole process group is
killed, and, as a child subreaper, any orphan re-parented to it (a daemon that left its group)
is killed on sight. `kill` requests end a child and its group at once. When the evaluator goes
away (the control socket closes) every child is killed and the zygote exits.

    python -m kernelfleet.evaluator._zygote CONTROL_FD [SLOT_DIR ...]
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from kernelfleet.evaluator import _confine
from kernelfleet.evaluator._wire import Channel, ChannelClosed, PacketChannel, ProtocolError

_PRELOAD = ("torch", "torch._dynamo", "kernelfleet.evaluator._judge", "kernelfleet.evaluator._candidate")


class _Zygote:
    def __init__(self, control: PacketChannel, slots: list[str]) -> None:
        self.control = control
        self.children: dict[int, dict[str, Any]] = {}  # pid -> {"id", "scratch", "slot"}
        self.tmp_root = Path(tempfile.mkdtemp(prefix="kf-sandbox-"))
        # Scratch slots, each a tmpfs of its own (bubblewrap levels): a child's scratch lives in
        # a free one, so filling it fills nobody else's. None free: the shared root.
        self.slots = slots
        self.pid = os.getpid()
        self.parent = os.getppid()
        self.wake: tuple[int, int] = (-1, -1)
        self.compile_ready = False

    def serve(self) -> None:
        # A child's exit wakes the loop at once (SIGCHLD through a wakeup pipe), so its group is
        # killed and its end reported without waiting for the next poll.
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_read, False)
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.wake = (wake_read, wake_write)
        self.control.send({"op": "ready", "pid": self.pid, "tmp": str(self.tmp_root)})
        while True:
            readable, _, _ = select.select([self.control.fileno(), wake_read], [], [], 0.5)
            if wake_read in readable:
                with contextlib.suppress(OSError):
                    os.read(wake_read, 4096)
            if self.control.fileno() in readable:
                fds: list[int] = []
                try:
                    message = self.control.receive(timeout=5.0, fds=fds)
                except (ChannelClosed, ProtocolError, TimeoutError, OSError):
                    break
                self.handle(message, fds)
            self.reap()
            self.sweep()
        self.shutdown()

    def handle(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message.get("op")
        if op == "spawn":
            self.spawn(message, fds)
        elif op == "kill":
            for pid, child in list(self.children.items()):
                if child["id"] == message.get("id"):
                    self.kill_group(pid)
        else:
            for fd in fds:
                os.close(fd)

    def spawn(self, request: dict[str, Any], fds: list[int]) -> None:
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            self.control.send({"op": "failed", "id": request.get("id"), "error": "two descriptors expected"})
            return
        if request.get("compiles"):
            self.ready_compile()
        taken = {child["slot"] for child in self.children.values()}
        slot = next((s for s in self.slots if s not in taken), None)
        scratch = Path(tempfile.mkdtemp(prefix="job-", dir=slot or self.tmp_root))
        (scratch / "xchg").mkdir()
        (scratch / "home").mkdir()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                self.control.close()
                for fd in self.wake:
                    os.close(fd)
                _child(request, fds[0], fds[1], scratch, protected=[self.pid, self.parent, 1])
            except BaseException:
                with contextlib.suppress(Exception):
                    os.write(2, traceback.format_exc().encode()[-4000:])
                code = 70
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        self.children[pid] = {"id": request.get("id"), "scratch": scratch, "slot": slot}
        self.control.send({"op": "spawned", "id": request.get("id"), "pid": pid, "scratch": str(scratch)})

    def ready_compile(self) -> None:
        """Once, before the first child that runs torch.compile: ready inductor here, so that
        every child forked afterwards inherits it. Each part cost every compiling process the
        same work for the same answer:

        - inductor checks each vector ISA the CPU claims by compiling a test program and loading
          it in a fresh Python (`import torch`), six times on an AVX-512 CPU: 30 to 40 s on 2
          busy cores. The zygote runs no candidate code, so the answer is its own; the test
          programs go to a private directory, removed at once.
        - a precompiled header is keyed by ATen's vector headers run through the preprocessor,
          so every process spent 17 s on it even when its kernels came from its build's cache
          and nothing was compiled. The header only saves parsing when a kernel compiles; the
          kernels are the same without it.
        - the cache keys hash torch's and Triton's installed sources (2 s).

        The zygote never touches CUDA, and none of this does."""
        if self.compile_ready:
            return
        self.compile_ready = True
        work = tempfile.mkdtemp(prefix="kf-inductor-")
        previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = work
        try:
            import torch._inductor.codecache
            import torch._inductor.compile_fx  # preloaded for the children
            import torch._inductor.config
            from torch._inductor import cpu_vec_isa
            from torch._inductor.runtime.triton_compat import HAS_TRITON, triton_key

            torch._inductor.config.cpp_cache_precompile_headers = False
            cpu_vec_isa.pick_vec_isa()
            torch._inductor.codecache.torch_key()
            if HAS_TRITON:
                triton_key()
            # Cached with the directory above: the children look theirs up afresh.
            torch._inductor.codecache.CacheBase.get_local_cache_path.cache_clear()
        except Exception:  # the children then check for themselves, as before
            traceback.print_exc()
        finally:
            if previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
            shutil.rmtree(work, ignore_errors=True)

    @staticmethod
    def kill_group(pid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue  # an orphan that was swept
            self.kill_group(pid)  # whatever it started in its group ends with it
            shutil.rmtree(child["scratch"], ignore_errors=True)
            if os.WIFSIGNALED(status):
                report = {"signal": os.WTERMSIG(status)}
            else:
                report = {"code": os.WEXITSTATUS(status)}
            with contextlib.suppress(OSError, ChannelClosed):
                self.control.send({"op": "exited", "id": child["id"], **report})

    def sweep(self) -> None:
        """Kill every process re-parented to the zygote that it did not spawn (orphans)."""
        for pid in _children_of(self.pid):
            if pid not in self.children:
                self.kill_group(pid)
        if not self.children:
            # Nothing runs: anything left in the scratch root (files a candidate put outside
            # its own directory, where no Landlock kept it out) goes.
            for entry in list(self.tmp_root.iterdir()):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        entry.unlink()

    def shutdown(self) -> None:
        for pid in list(self.children):
            self.kill_group(pid)
        for pid in _children_of(self.pid):
            self.kill_group(pid)
        shutil.rmtree(self.tmp_root, ignore_errors=True)


def _children_of(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as handle:
                found.extend(int(p) for p in handle.read().split())
        except (OSError, ValueError):
            continue
    return found


def _child(
    request: dict[str, Any], channel_fd: int, log_fd: int, scratch: Path, protected: list[int]
) -> None:
    """In the forked child: walls first, then the role (judge or candidate)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setpgid(0, 0)
    _confine.die_with_parent()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    env = {str(k): str(v) for k, v in dict(request.get("env") or {}).items()}
    # A C++/CUDA candidate works in its own build directory (keyed by its source, and already
    # the one place besides its scratch it may write): an extension it builds under a relative
    # path (`./build`) is then the build pool's in every process, not compiled again in each.
    workdir = env.get("TORCH_EXTENSIONS_DIR") if request.get("role") == "candidate" else None
    env.setdefault("HOME", str(scratch / "home"))
    env.setdefault("TMPDIR", str(scratch))
    env.setdefault("TRITON_CACHE_DIR", str(scratch / "triton"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(scratch / "inductor"))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(scratch / "extensions"))
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL")}
    os.environ.clear()
    os.environ.update({**base, **env})
    tempfile.tempdir = str(scratch)
    _own_inductor_headers()
    os.chdir(workdir or scratch)
    walls = request.get("walls") or {}
    limits = walls.get("limits") or {}
    processes = limits.get("processes")
    _confine.apply_limits(
        _confine.Limits(
            memory_bytes=limits.get("memory_bytes"),
            file_bytes=limits.get("file_bytes"),
            # RLIMIT_NPROC counts every task of the user: the limit is what it may add.
            processes=processes + _tasks_of_user() if processes else None,
        )
    )
    _confine.drop_capabilities()
    if walls.get("landlock"):
        # /proc/self: its own /proc/<pid> (CUDA writes there when it starts, e.g. to name its
        # threads; without it cuInit fails). Other processes' entries stay closed.
        write = [str(scratch), "/dev/shm", "/proc/self", *walls.get("write", [])]
        _confine.apply_landlock(walls.get("read", []), write, devices=["/dev"])
    if walls.get("seccomp"):
        _confine.apply_seccomp(protected)
    _confine.not_dumpable()
    channel = Channel(socket.socket(fileno=channel_fd))
    role = request.get("role")
    if role == "judge":
        from kernelfleet.evaluator import _judge

        _judge.serve(channel, scratch)
    elif role == "candidate":
        from kernelfleet.evaluator import _candidate

        _candidate.serve(channel, scratch)
    else:
        raise ValueError(f"unknown role {role!r}")
    sys.stdout.flush()
    sys.stderr.flush()


def _own_inductor_headers() -> None:
    """Inductor places its precompiled headers below the temporary directory it sees when its
    codecache is imported; imported in the zygote (`ready_compile`), that was the zygote's,
    where no child may write. Each child keeps them in its own scratch, as its own import did."""
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is not None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        codecache._HEADER_DIR = os.path.join(default_cache_dir(), "precompiled_headers")  # type: ignore[attr-defined]
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")  # type: ignore[attr-defined]


def _tasks_of_user() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid == uid:
                count += len(os.listdir(f"/proc/{entry}/task"))
        except OSError:
            continue
    return count


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    control = PacketChannel(socket.socket(fileno=int(args[0])))
    _confine.child_subreaper()
    _confine.not_dumpable()  # its children run candidates: none may trace or read it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the evaluator's to handle
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    _Zygote(control, args[1:]).serve()


if __name__ == "__main__":
    main()
