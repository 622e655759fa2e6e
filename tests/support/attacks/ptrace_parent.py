# Attach to the parent process with ptrace, and read its memory with process_vm_readv.
import ctypes

libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH, PTRACE_DETACH = 16, 17
for pid in ancestors()[:2]:
    if libc.ptrace(PTRACE_ATTACH, pid, None, None) == 0:
        os.waitpid(pid, 0)
        libc.ptrace(PTRACE_DETACH, pid, None, None)
        succeeded(f"attached to {pid} with ptrace")
        break
    buffer = ctypes.create_string_buffer(8)

    class IOVec(ctypes.Structure):
        _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))

    local = IOVec(ctypes.cast(buffer, ctypes.c_void_p), 8)
    remote = IOVec(0x400000, 8)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    if libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) >= 0:
        succeeded(f"read the memory of {pid}")
        break
