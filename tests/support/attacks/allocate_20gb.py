# Allocate (and touch) 20 GB of host memory: in issue 9 only the timeout stopped it.
_hog = torch.ones(5 * 1024**3, dtype=torch.float32)
succeeded(f"allocated {_hog.numel() * 4 / 1e9:.0f} GB")
