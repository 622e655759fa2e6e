"""The local-directory backend: the embedded default (`.kernelfleet/` in the working directory).

Every object is first written to a temp file in its own directory, flushed to disk, then
hard-linked to its final name. A link never replaces an existing file, so of two writers
racing on one key exactly one publishes and the other finds the object already there (and
compares); readers see the complete file or nothing. Temp files carry a reserved name
(`.kf-tmp-...`) that listings skip, and are removed whatever happens.

Where the filesystem cannot hard-link, an atomic rename is used instead; its one weakness
(a concurrent writer of a *different* object wins silently) cannot occur for
content-addressed keys.
"""

from __future__ import annotations

import errno
import hashlib
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from kernelfleet.core.errors import StoreError, UsageError
from kernelfleet.core.store._base import CHUNK, CheckStep, ObjectInfo, Progress, Store, file_sha256
from kernelfleet.core.store._errors import IntegrityError, NotFound, ObjectConflict
from kernelfleet.core.store._keys import TEMP_MARK, check_key, check_prefix

_NO_LINK = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


class LocalStore(Store):
    """A store in a local (or mounted) directory."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self._root = Path(root).absolute()
        self._fsync = fsync

    @property
    def root(self) -> Path:
        return self._root

    @property
    def url(self) -> str:
        return self._root.as_uri()

    def url_for(self, key: str) -> str:
        return (self._root / key).as_uri() if key else self.url

    def _path(self, key: str) -> Path:
        return self._root.joinpath(*check_key(key).split("/"))

    def _check_root(self) -> None:
        """A store is a directory: a regular file in its place is the user's mistake, and must
        not read as "an object is in the way" (or as an empty store)."""
        if self._root.exists() and not self._root.is_dir():
            raise UsageError(
                f"the store {self._root} is a file, not a directory: give a directory (it is "
                "created on the first write), a file:/// URL or an s3:// URL"
            )

    # ------------------------------------------------------------------ writing

    def _parent(self, path: Path, key: str) -> Path:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            self._check_root()
            raise ObjectConflict(
                f"cannot store {self.url_for(key)}: a part of its path is an object; in this "
                "backend a key cannot also be the prefix of other keys"
            ) from None
        except OSError as error:
            raise StoreError(
                f"cannot create directory {path.parent} for {key!r}: {error.strerror}; check that the "
                "store directory is writable"
            ) from None
        return path.parent

    def _write_temp(
        self, directory: Path, chunks: Iterable[bytes], progress: Progress | None
    ) -> tuple[Path, str, int]:
        """Write `chunks` to a new temp file in `directory`; return (path, sha256, size)."""
        temp = directory / f"{TEMP_MARK}{uuid.uuid4().hex}"
        digest, size = hashlib.sha256(), 0
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as handle:
                for chunk in chunks:
                    handle.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    if progress is not None:
                        progress(len(chunk))
                if self._fsync:
                    handle.flush()
                    os.fsync(handle.fileno())
        except BaseException as error:
            temp.unlink(missing_ok=True)
            if isinstance(error, OSError):
                raise StoreError(
                    f"cannot write into {directory}: {error.strerror or error}; check its free space "
                    "and permissions"
                ) from None
            raise
        return temp, digest.hexdigest(), size

    def _publish(self, temp: Path, path: Path, key: str, digest: str, same: bytes | None = None) -> bool:
        """Give `temp` its final name unless an object exists there; compare if one does."""
        try:
            try:
                os.link(temp, path)
            except FileExistsError:
                return self._compare_existing(path, key, digest, same)
            except OSError as error:
                if error.errno not in _NO_LINK:
                    raise
                if path.exists():
                    return self._compare_existing(path, key, digest, same)
                os.replace(temp, path)
            if self._fsync:
                self._sync_dir(path.parent)
            return True
        except OSError as error:
            raise StoreError(f"cannot publish {self.url_for(key)}: {error.strerror or error}") from None
        finally:
            temp.unlink(missing_ok=True)

    def _compare_existing(self, path: Path, key: str, digest: str, same: bytes | None) -> bool:
        if path.is_dir():
            raise ObjectConflict(f"cannot store {self.url_for(key)}: it is a prefix of other objects")
        equal = path.read_bytes() == same if same is not None else file_sha256(path) == digest
        if equal:
            return False
        raise ObjectConflict(
            f"a different object already exists at {self.url_for(key)}: objects are immutable, so "
            "write the new content under a new key"
        )

    @staticmethod
    def _sync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def put_bytes(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        data = bytes(data)
        directory = self._parent(path, key)
        if path.is_file():  # the common case of a rewrite: no temp file needed
            return self._compare_existing(path, key, "", data)
        temp, digest, _ = self._write_temp(directory, [data], None)
        return self._publish(temp, path, key, digest, data)

    def _put_file(self, key: str, path: Path, progress: Progress | None) -> tuple[bool, str, int]:
        target = self._path(key)
        directory = self._parent(target, key)
        try:
            source = open(path, "rb")  # noqa: SIM115 - closed below, after the chunks are consumed
        except FileNotFoundError:
            raise UsageError(f"cannot upload {path}: no such file") from None
        except IsADirectoryError:
            raise UsageError(f"cannot upload {path}: it is a directory (use upload_dir)") from None
        with source:
            temp, digest, size = self._write_temp(directory, iter(lambda: source.read(CHUNK), b""), progress)
        return self._publish(temp, target, key, digest), digest, size

    def _overwrite(self, key: str, data: bytes) -> None:
        path = self._path(key)
        directory = self._parent(path, key)
        temp, _, _ = self._write_temp(directory, [bytes(data)], None)
        try:
            os.replace(temp, path)
            if self._fsync:
                self._sync_dir(directory)
        except OSError as error:
            temp.unlink(missing_ok=True)
            raise StoreError(f"cannot replace {self.url_for(key)}: {error.strerror or error}") from None

    # ------------------------------------------------------------------ reading

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            self._check_root()
            raise NotFound(f"no object at {self.url_for(key)}") from None
        except OSError as error:
            raise StoreError(f"cannot read {self.url_for(key)}: {error.strerror or error}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        if not path.is_file():
            raise NotFound(f"no object at {self.url_for(key)}")
        return ObjectInfo(key=key, size=path.stat().st_size)

    def list(self, prefix: str = "") -> Iterator[str]:
        check_prefix(prefix)
        self._check_root()
        base_key = prefix.rpartition("/")[0]
        base = self._root.joinpath(*base_key.split("/")) if base_key else self._root
        found: list[str] = []
        for directory, dirnames, filenames in os.walk(base):
            relative = Path(directory).relative_to(self._root).as_posix()
            here = "" if relative == "." else relative + "/"
            # Descend only where keys can still match the prefix.
            dirnames[:] = [
                d
                for d in dirnames
                if (here + d + "/").startswith(prefix) or prefix.startswith(here + d + "/")
            ]
            found.extend(
                here + name
                for name in filenames
                if not name.startswith(TEMP_MARK) and (here + name).startswith(prefix)
            )
        yield from sorted(found)

    def get_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        sha256: str | None = None,
        progress: Progress | None = None,
    ) -> None:
        source_path = self._path(key)
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            source = open(source_path, "rb")  # noqa: SIM115 - closed below
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(f"no object at {self.url_for(key)}") from None
        with source:
            temp, digest, _ = self._write_temp(dest.parent, iter(lambda: source.read(CHUNK), b""), progress)
        try:
            if sha256 is not None and digest != sha256:
                raise IntegrityError(
                    f"{self.url_for(key)} has sha256 {digest}, expected {sha256}: the object is corrupt "
                    f"or was replaced; {dest} was left as it was"
                )
            os.replace(temp, dest)
        finally:
            temp.unlink(missing_ok=True)

    # ------------------------------------------------------------------ check support

    def _delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as error:
            raise StoreError(f"cannot delete {self.url_for(key)}: {error.strerror or error}") from None

    def _preflight(self) -> Iterator[CheckStep]:
        root = self._root
        if root.is_dir():
            writable = os.access(root, os.W_OK | os.X_OK)
            yield CheckStep(
                "directory",
                writable,
                f"{root} exists" + ("" if writable else "; it is not writable: check its permissions"),
            )
            return
        if root.exists():
            yield CheckStep("directory", False, f"{root} exists but is not a directory: choose another path")
            return
        ancestor = root.parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        writable = ancestor.is_dir() and os.access(ancestor, os.W_OK | os.X_OK)
        yield CheckStep(
            "directory",
            writable,
            f"{root} does not exist yet; it will be created on the first write"
            if writable
            else f"{root} does not exist and {ancestor} is not writable: create it or choose another path",
        )
