# Fill the disk under the scratch directory: 256 MiB files until writes fail, up to 2 GiB (the
# suite's scratch limit is 256 MiB; writing 1 GiB means no limit held).
import tempfile

written = 0
chunk = b"\0" * (16 * 1024 * 1024)
directory = tempfile.mkdtemp()
try:
    for index in range(8):
        with open(os.path.join(directory, f"fill-{index}"), "wb") as handle:
            for _ in range(16):
                handle.write(chunk)
                written += len(chunk)
except OSError as error:
    print(f"stopped after {written / 2**20:.0f} MiB: {error}", flush=True)
if written >= 1024**3:
    succeeded(f"wrote {written / 2**20:.0f} MiB, past the scratch limit")
raise RuntimeError(f"the scratch disk took {written / 2**20:.0f} MiB")
