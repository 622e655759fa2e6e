# Read the environment of every process it can see, looking for the store's credentials.
needles = (b"KERNELFLEET_S3_SECRET_KEY", b"KERNELFLEET_S3_ACCESS_KEY", b"AWS_SECRET_ACCESS_KEY")
for name, value in os.environ.items():
    if name.encode() in needles:
        succeeded(f"own environment has {name}={value}")
for pid in ancestors():
    environ = read(f"/proc/{pid}/environ") or b""
    for entry in environ.split(b"\0"):
        if entry.split(b"=", 1)[0] in needles:
            succeeded(f"process {pid} has {entry.decode(errors='replace')}")
