"""Run leases: one process at a time works on a run, on any backend.

A lease is a chain of immutable objects, `<prefix>/lease/<epoch>.json`, each naming an owner
(host, pid, a random token) and an expiry. Taking or renewing the lease is writing the next
epoch: the store's create-only writes make that a compare-and-swap, so of two processes that
race for the same epoch exactly one wins (the local backend links atomically; on S3, where a
write is a plain PUT, the winner reads its epoch back after a short settling delay and a loser
finds someone else's). The holder renews well before expiry; a process killed outright leaves
a lease that simply expires, or, on the machine it ran on, one that the next process takes at once
(the record names the holder's pid and start time, so a dead holder is told from a live one).
Releasing writes a last epoch marked released.

A second process on a leased run waits (up to `wait_s`) or is refused with a message that says
who holds the run and until when.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, ValidationError

from kernelfleet.core.errors import StoreError, UsageError
from kernelfleet.core.store._base import Store, encode_json
from kernelfleet.core.store._errors import ObjectConflict

LEASE_DIR = "lease"


class LeaseHeld(UsageError):
    """Another live process holds the run's lease."""


class LeaseLost(StoreError):
    """This process's lease was taken over (it could not renew it in time)."""


class LeaseRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    epoch: int
    owner: str
    host: str = ""
    pid: int = 0
    token: str = ""
    acquired_at: float = 0.0
    expires_at: float = 0.0
    released: bool = False
    started: int = 0  # the holder's start time (clock ticks since boot), which tells it from a reused pid

    def live(self, now: float) -> bool:
        return not self.released and self.expires_at > now

    def holder_died_here(self) -> bool:
        """The holder ran on this machine and is gone (killed outright): its lease need not be
        waited out. A record without a start time, or from another host, is never judged so."""
        return (
            self.host == socket.gethostname()
            and self.pid > 0
            and self.started > 0
            and (process_started(self.pid) != self.started)
        )

    def describe(self) -> str:
        until = datetime.fromtimestamp(self.expires_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"{self.owner} (host {self.host}, pid {self.pid}) until {until}"


def process_started(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (/proc/PID/stat), None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _epoch_key(prefix: str, epoch: int) -> str:
    return f"{prefix.strip('/')}/{LEASE_DIR}/{epoch:010d}.json"


def current_lease(store: Store, prefix: str) -> LeaseRecord | None:
    """The newest lease record of the run, if it ever had one."""
    keys = list(store.list(f"{prefix.strip('/')}/{LEASE_DIR}/"))
    for key in reversed(keys):
        try:
            record = LeaseRecord.model_validate(store.get_json(key))
        except (ValidationError, StoreError):
            continue
        # The epoch is the key's: a record that says otherwise (damaged, or written by hand) must
        # not send the next writer to an epoch that exists already, again and again.
        epoch = key.rsplit("/", 1)[-1].removesuffix(".json")
        return record.model_copy(update={"epoch": int(epoch)}) if epoch.isdigit() else record
    return None


class RunLease:
    """Hold the lease of the run at `prefix` for the duration of a `with` block."""

    def __init__(
        self,
        store: Store,
        prefix: str,
        *,
        ttl_s: float = 120.0,
        wait_s: float = 0.0,
        owner: str | None = None,
        settle_s: float | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise UsageError("a lease needs a positive time to live")
        self.store = store
        self.prefix = prefix.strip("/")
        self.ttl_s = ttl_s
        self.wait_s = max(0.0, wait_s)
        self.token = secrets.token_hex(8)
        self.host = socket.gethostname()
        self.owner = owner or f"kernelfleet@{self.host}"
        # A plain PUT (S3) can be overwritten by a racer that read the same epoch: wait a moment
        # and read the epoch back before believing it is ours.
        self.settle_s = settle_s if settle_s is not None else (1.0 if store.url.startswith("s3://") else 0.0)
        self.epoch = -1
        self._expires_at = 0.0  # of the last epoch this process wrote (read when the store is away)
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- taking it

    def _write(self, epoch: int, *, released: bool = False) -> bool:
        now = time.time()
        record = LeaseRecord(
            epoch=epoch,
            owner=self.owner,
            host=self.host,
            pid=os.getpid(),
            started=process_started(os.getpid()) or 0,
            token=self.token,
            acquired_at=now,
            expires_at=0.0 if released else now + self.ttl_s,
            released=released,
        )
        key = _epoch_key(self.prefix, epoch)
        try:
            self.store.put_bytes(key, encode_json(record))
        except ObjectConflict:
            return False
        if self.settle_s:
            time.sleep(self.settle_s)
        try:
            back = LeaseRecord.model_validate(self.store.get_json(key))
        except (ValidationError, StoreError):
            return False
        if back.token != self.token:
            return False
        self._expires_at = record.expires_at
        return True

    def acquire(self) -> RunLease:
        deadline = time.monotonic() + self.wait_s
        while True:
            latest = current_lease(self.store, self.prefix)
            now = time.time()
            if (
                latest is None
                or not latest.live(now)
                or latest.token == self.token
                or latest.holder_died_here()
            ):
                epoch = 0 if latest is None else latest.epoch + 1
                if self._write(epoch):
                    self.epoch = epoch
                    break
                continue  # someone else wrote that epoch first: look again
            if time.monotonic() >= deadline:
                raise LeaseHeld(
                    f"run {self.prefix} is in use by {latest.describe()}: two processes on one run would "
                    "measure each other. Wait for it to finish, pass --lease-wait SECONDS to wait for it, "
                    f"or use another run; a lease left by a process killed on another machine expires "
                    f"{self.ttl_s:g} s after its last renewal"
                )
            time.sleep(min(2.0, self.ttl_s / 4, max(0.05, deadline - time.monotonic())))
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name="kernelfleet-lease", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self._write(self.epoch + 1):
                    self.epoch += 1
                    continue
                latest = current_lease(self.store, self.prefix)
                who = latest.describe() if latest is not None else "another process"
                self.lost = f"the lease of run {self.prefix} was taken over by {who}"
                return
            except StoreError as error:  # a store outage: try again at the next renewal
                if time.time() > self._expires_at:
                    self.lost = (
                        f"the lease of run {self.prefix} expired while the store was unreachable: {error}"
                    )
                    return

    def check(self) -> None:
        """Raise LeaseLost when another process has taken the run over."""
        if self.lost:
            raise LeaseLost(f"{self.lost}; this process stops so that the two do not both write the run")

    # -- giving it back

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if self.epoch >= 0 and not self.lost:
            with contextlib.suppress(StoreError):  # if the store is away, it expires on its own
                self._write(self.epoch + 1, released=True)
        self.epoch = -1

    def __enter__(self) -> RunLease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
