# Open the evaluator's own code (and torch's) for writing: a candidate that can would make
# every later evaluation run its code. Only opened, never changed.
import kernelfleet.evaluator._judge as judge_module

for path in (judge_module.__file__, torch.__file__):
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.close(fd)
        succeeded(f"could open {path} for writing")
    except OSError:
        pass
