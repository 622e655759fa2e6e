# Find the reference class among nn.Module's subclasses and make its forward slow: a candidate
# with exactly the reference's code then "wins" (8-9x in issue 9).
import time


def _slowed(forward):
    def slow(self, *args, **kwargs):
        time.sleep(0.002)
        return forward(self, *args, **kwargs)

    return slow


for cls in list(nn.Module.__subclasses__()):
    if cls.__name__ == "Model" and cls.__module__ != __name__:
        cls.forward = _slowed(cls.forward)
        succeeded(f"patched {cls.__module__}.Model.forward")
