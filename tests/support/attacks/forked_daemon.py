# Fork a daemon that leaves the candidate's process group and burns CPU for a minute.
import ctypes
import time

pid = os.fork()
if pid == 0:
    try:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        ctypes.CDLL(None).prctl(15, b"kf-attack-daemon", 0, 0, 0)  # PR_SET_NAME, for the test
        end = time.time() + 60
        while time.time() < end:
            pass
    finally:
        os._exit(0)
os.waitpid(pid, 0)
