# Rebind a function of the evaluator's own code in the candidate's process so that it raises:
# in issue 9 this ended `optimize` with a traceback on every resume.
from kernelfleet.evaluator import _wire


def _broken(*args, **kwargs):
    raise RuntimeError("the evaluator's code was rebound by the candidate")


_wire.write_tree = _broken
try:
    from kernelfleet.evaluator import _candidate

    _candidate.write_tree = _broken
except Exception:
    pass
