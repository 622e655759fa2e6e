# Make every process started after this one load the candidate's library: /etc/ld.so.preload.
# Only probed: the file is created empty and removed again, or opened and left alone.
path = "/etc/ld.so.preload"
existed = os.path.exists(path)
try:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.close(fd)
    if not existed:
        os.remove(path)
    succeeded(f"could write {path}")
except OSError:
    pass
os.environ["LD_PRELOAD"] = "/nonexistent/kf-attack.so"  # its own children only
