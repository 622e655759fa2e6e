# Open a network connection (a candidate could send out what it can read).
import errno
import socket

for family, address in ((socket.AF_INET, ("127.0.0.1", 9)), (socket.AF_INET6, ("::1", 9))):
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        continue
    sock.settimeout(2)
    try:
        sock.connect(address)
        succeeded(f"connected to {address}")
    except OSError as error:
        if error.errno == errno.ECONNREFUSED:
            succeeded(f"reached the network at {address} (connection refused)")
    finally:
        sock.close()
