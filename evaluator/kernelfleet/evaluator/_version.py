"""The evaluator's version: part of every result key.

Bump it whenever a change could alter a verdict or a timing (a new defence, a different
protocol), so that cached results from the old evaluator are never mistaken for new ones.
"""

EVALUATOR_VERSION = "0.8.10"  # 0.6.0 was a withdrawn timing protocol: never reused
