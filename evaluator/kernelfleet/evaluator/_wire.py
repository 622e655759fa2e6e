"""What crosses between the evaluator and a sandboxed process: JSON frames and tensor files.

Nothing that comes out of a sandbox is unpickled: a candidate's process holds its own end of
every channel, so whatever it sends is data to check, never code to run. Messages are JSON
objects in length-prefixed frames with a size limit; tensors travel as files of raw bytes
behind a JSON header whose every field (dtype, shape, offsets, nesting) is checked against the
file before a byte is interpreted.
"""

from __future__ import annotations

import array
import contextlib
import json
import math
import os
import socket
import struct
import time
from typing import Any

FRAME_LIMIT = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")


class ChannelClosed(EOFError):
    """The other side closed its end (it exited or was killed)."""


class ProtocolError(ValueError):
    """The other side sent something that is not a valid message."""


class Channel:
    """One end of a stream socket carrying JSON frames (and, on request, file descriptors)."""

    def __init__(self, sock: socket.socket, limit: int = FRAME_LIMIT) -> None:
        self.sock = sock
        self.limit = limit
        self._buffer = b""

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        data = json.dumps(message, separators=(",", ":"), allow_nan=True).encode("utf-8")
        payload = _HEADER.pack(len(data)) + data
        try:
            if fds:
                self.sock.sendmsg(
                    [payload[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                )
                payload = payload[1:]
            self.sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError) as error:
            raise ChannelClosed(str(error)) from None

    def _fill(self, count: int, deadline: float | None, fds: list[int] | None) -> None:
        while len(self._buffer) < count:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("no message in time")
                self.sock.settimeout(remaining)
            else:
                self.sock.settimeout(None)
            try:
                if fds is not None:
                    data, ancillary, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(16 * 4))
                    for level, kind, raw in ancillary:
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                            received = array.array("i")
                            received.frombytes(raw[: len(raw) - len(raw) % 4])
                            fds.extend(received)
                else:
                    data = self.sock.recv(min(1 << 20, max(count - len(self._buffer), 65536)))
            except TimeoutError:
                raise TimeoutError("no message in time") from None
            except ConnectionResetError:
                data = b""
            if not data:
                raise ChannelClosed("the other side closed the channel")
            self._buffer += data

    def receive(self, timeout: float | None = None, fds: list[int] | None = None) -> dict[str, Any]:
        """The next message; TimeoutError after `timeout` seconds; ChannelClosed at the end;
        ProtocolError for anything that is not a JSON object within the size limit."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._fill(_HEADER.size, deadline, fds)
        (size,) = _HEADER.unpack(self._buffer[: _HEADER.size])
        if size > self.limit:
            raise ProtocolError(f"a message of {size} bytes, over the {self.limit}-byte limit")
        self._fill(_HEADER.size + size, deadline, fds)
        data = self._buffer[_HEADER.size : _HEADER.size + size]
        self._buffer = self._buffer[_HEADER.size + size :]
        try:
            message = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ProtocolError(f"not JSON: {error}") from None
        if not isinstance(message, dict):
            raise ProtocolError(f"a JSON {type(message).__name__}, not an object")
        return message


class PacketChannel:
    """One end of a SOCK_SEQPACKET socket: one JSON message per packet, with the file
    descriptors sent alongside it (message boundaries keep every descriptor with its message,
    however many senders write at once)."""

    def __init__(self, sock: socket.socket, limit: int = 1 << 20) -> None:
        self.sock = sock
        self.limit = limit

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def hang_up(self) -> None:
        """End the conversation for both sides at once, then close. A plain close does not
        while another thread is blocked receiving on this socket: that call holds the socket
        open, so the peer never reads its end. A shutdown ends it for every holder, and wakes
        the blocked receive too."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.close()

    def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        data = json.dumps(message, separators=(",", ":")).encode("utf-8")
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            self.sock.sendmsg([data], ancillary)
        except (BrokenPipeError, ConnectionResetError) as error:
            raise ChannelClosed(str(error)) from None

    def receive(self, timeout: float | None = None, fds: list[int] | None = None) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        try:
            data, ancillary, flags, _ = self.sock.recvmsg(self.limit, socket.CMSG_SPACE(16 * 4))
        except TimeoutError:
            raise TimeoutError("no message in time") from None
        except ConnectionResetError:
            data, ancillary, flags = b"", [], 0
        received: list[int] = []
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                numbers = array.array("i")
                numbers.frombytes(raw[: len(raw) - len(raw) % 4])
                received.extend(numbers)
        if fds is not None:
            fds.extend(received)
        else:
            for fd in received:
                os.close(fd)
        if not data:
            raise ChannelClosed("the other side closed the channel")
        if flags & socket.MSG_TRUNC:
            raise ProtocolError(f"a message over the {self.limit}-byte limit")
        try:
            message = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ProtocolError(f"not JSON: {error}") from None
        if not isinstance(message, dict):
            raise ProtocolError(f"a JSON {type(message).__name__}, not an object")
        return message


def channel_pair() -> tuple[Channel, socket.socket]:
    """A connected pair: a Channel for this side, the raw socket for the other process."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Channel(mine), theirs


# ---------------------------------------------------------------- tensors as files

_MAGIC = b"KFT1"
_ALIGN = 64
MAX_LEAVES = 4096
MAX_DEPTH = 16
MAX_DIMS = 16
DTYPES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex64",
    "complex128",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)


class MalformedTensors(ProtocolError):
    """A tensor file that does not describe itself truthfully."""


def _encode_number(value: float) -> Any:
    return value if math.isfinite(value) else repr(value)


def write_tree(path: str, value: Any) -> None:
    """Write `value` (tensors, numbers, None, strings, in lists, tuples and dicts) to `path`."""
    import torch

    blobs: list[Any] = []  # tensors' bytes (numpy arrays) and padding
    offset = 0

    def node(item: Any, depth: int) -> Any:
        nonlocal offset
        if depth > MAX_DEPTH:
            raise ValueError("the value is nested too deeply to ship")
        if isinstance(item, torch.Tensor):
            tensor = item.detach()
            device = tensor.device.type
            if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
                tensor = torch.Tensor._make_subclass(torch.Tensor, tensor)
            data = _host_copy(tensor)
            # The tensor's own bytes, written as they are: no copy of a large output into bytes.
            raw = data.reshape(-1).view(torch.uint8).numpy()
            size = int(raw.nbytes)
            dtype = str(data.dtype).removeprefix("torch.")
            entry = {
                "t": "tensor",
                "dtype": dtype,
                "shape": list(data.shape),
                "offset": offset,
                "nbytes": size,
                "device": device,
            }
            blobs.append(raw)
            pad = (-size) % _ALIGN
            if pad:
                blobs.append(b"\0" * pad)
            offset += size + pad
            return entry
        if isinstance(item, bool):
            return {"t": "bool", "v": item}
        if isinstance(item, int):
            return {"t": "int", "v": str(item)}
        if isinstance(item, float):
            return {"t": "float", "v": _encode_number(item)}
        if isinstance(item, complex):
            return {"t": "complex", "v": [_encode_number(item.real), _encode_number(item.imag)]}
        if item is None:
            return {"t": "none"}
        if isinstance(item, str):
            return {"t": "str", "v": item[:10000]}
        if isinstance(item, list | tuple):
            return {
                "t": "list" if isinstance(item, list) else "tuple",
                "items": [node(x, depth + 1) for x in item],
            }
        if isinstance(item, dict):
            return {"t": "dict", "items": [[str(k), node(v, depth + 1)] for k, v in item.items()]}
        return {"t": "other", "type": type(item).__qualname__[:200]}

    header = json.dumps(node(value, 0)).encode("utf-8")
    start = _align(len(_MAGIC) + 4 + len(header))
    # A new file only: a name the other side planted (a link, a FIFO) is never written through.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(_MAGIC + struct.pack(">I", len(header)) + header)
        handle.write(b"\0" * (start - len(_MAGIC) - 4 - len(header)))
        for blob in blobs:
            handle.write(blob)


def _host_copy(tensor: Any) -> Any:
    """A contiguous host copy of `tensor` to write. From a GPU it lands in pinned memory: the copy
    runs at the bus's speed, and torch's caching host allocator hands the same block to the
    next copy of its size, where `.cpu()` allocated fresh pageable memory every time (for 1:36,
    268 MB of first touches and a staged copy on each of its correctness calls)."""
    if tensor.device.type != "cuda":
        return tensor.contiguous()
    host = _host_buffer(tensor.shape, tensor.dtype, pinned=True)
    host.copy_(tensor)  # synchronous: the bytes are there before they are written
    return host


def _host_buffer(shape: Any, dtype: Any, pinned: bool) -> Any:
    """An empty host tensor, pinned when asked and the host will lock that much memory; else
    pageable (the copy still works, slower)."""
    import torch

    if pinned:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:
            pass
    return torch.empty(shape, dtype=dtype)


def _align(value: int) -> int:
    return value + (-value) % _ALIGN


def _decode_number(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    raise MalformedTensors(f"{value!r} is not a number")


def read_tree(path: str, limit_bytes: int, device: Any = None) -> tuple[Any, list[str]]:
    """Read a file written by `write_tree`, checking everything: (value, the device type each
    tensor had when it was written). Tensors come back as plain tensors on `device`. A link,
    a FIFO or anything but a regular file is refused, as is anything that does not add up
    (MalformedTensors)."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MalformedTensors("the file was not written") from None
    except OSError as error:
        raise MalformedTensors(f"cannot open it: {error.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MalformedTensors("not a regular file")
        if info.st_size > limit_bytes:
            raise MalformedTensors(f"{info.st_size} bytes, more than the {limit_bytes} it may have")
        return _read_tensors(fd, info.st_size, device)
    finally:
        os.close(fd)


def _size(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MalformedTensors("offset and size must be non-negative integers")
    return value


def _read_exactly(fd: int, position: int, into: Any) -> None:
    """Fill `into` from `position` of the file, or MalformedTensors: the file is the other side's,
    and it may shrink or change while it is read; its structure was checked against the header
    read once, and its bytes are data."""
    view = memoryview(into).cast("B")
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], position + done)
        if count <= 0:
            raise MalformedTensors("the file ended before the data its header describes")
        done += count


def _read_tensors(fd: int, file_size: int, device: Any) -> tuple[Any, list[str]]:
    """The value of a tensor file: its header read and checked once, then each tensor read
    straight into its own memory (one copy, not the file into bytes and each tensor out of them)."""
    import torch

    lead = bytearray(min(8, file_size))
    _read_exactly(fd, 0, lead)
    if bytes(lead[:4]) != _MAGIC or len(lead) < 8:
        raise MalformedTensors("not a tensor file")
    (header_size,) = struct.unpack(">I", bytes(lead[4:8]))
    if 8 + header_size > file_size:
        raise MalformedTensors("the header runs past the end of the file")
    header = bytearray(header_size)
    _read_exactly(fd, 8, header)
    try:
        tree = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MalformedTensors(f"the header is not JSON: {error}") from None
    start = _align(8 + header_size)
    body_size = max(0, file_size - start)
    count = 0
    devices: list[str] = []
    pinned = device is not None and torch.device(device).type == "cuda"

    def build(item: Any, depth: int) -> Any:
        nonlocal count
        count += 1
        if depth > MAX_DEPTH or count > MAX_LEAVES:
            raise MalformedTensors("nested too deeply or too many values")
        if not isinstance(item, dict) or not isinstance(item.get("t"), str):
            raise MalformedTensors("a node without a type")
        kind = item["t"]
        if kind == "tensor":
            dtype_name = item.get("dtype")
            shape = item.get("shape")
            offset, nbytes = _size(item.get("offset")), _size(item.get("nbytes"))
            if dtype_name not in DTYPES:
                raise MalformedTensors(f"dtype {dtype_name!r} is not one a tensor may have here")
            if (
                not isinstance(shape, list)
                or len(shape) > MAX_DIMS
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
            ):
                raise MalformedTensors(f"shape {shape!r} is not a list of sizes")
            dtype = getattr(torch, dtype_name)
            numel = math.prod(shape)
            expected = numel * torch.empty((), dtype=dtype).element_size()
            if expected != nbytes or offset + nbytes > body_size:
                raise MalformedTensors(
                    f"a {dtype_name} tensor of shape {shape} needs {expected} bytes; the file gives {nbytes} "
                    f"at {offset} of {body_size}"
                )
            if numel:
                # Read into pinned memory when the tensor goes to a GPU (see _host_copy).
                raw = _host_buffer(nbytes, torch.uint8, pinned)
                _read_exactly(fd, start + offset, raw.numpy())
                tensor = raw.view(dtype).reshape(shape)
            else:
                tensor = torch.empty(shape, dtype=dtype)
            devices.append(str(item.get("device", "cpu")))
            return tensor.to(device) if device is not None else tensor
        if kind == "bool":
            return bool(item.get("v"))
        if kind == "int":
            try:
                return int(str(item.get("v"))[:400])
            except ValueError:
                raise MalformedTensors("an integer that is not one") from None
        if kind == "float":
            return _decode_number(item.get("v"))
        if kind == "complex":
            parts = item.get("v")
            if not isinstance(parts, list) or len(parts) != 2:
                raise MalformedTensors("a complex number without two parts")
            return complex(_decode_number(parts[0]), _decode_number(parts[1]))
        if kind == "none":
            return None
        if kind == "str":
            return str(item.get("v", ""))[:10000]
        if kind in ("list", "tuple"):
            items = item.get("items")
            if not isinstance(items, list):
                raise MalformedTensors("a sequence without items")
            built = [build(x, depth + 1) for x in items]
            return built if kind == "list" else tuple(built)
        if kind == "dict":
            items = item.get("items")
            if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 for p in items):
                raise MalformedTensors("a mapping without pairs")
            return {str(k): build(v, depth + 1) for k, v in items}
        if kind == "other":
            return Opaque(str(item.get("type", "?"))[:200])
        raise MalformedTensors(f"unknown node type {kind!r}")

    value = build(tree, 0)
    return value, devices


class Opaque:
    """A value that could not be shipped (an object of some other type): it compares unequal."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<{self.type_name}>"
