"""kernelfleet.operator: the kopf operator that reconciles OptimizationJob and TrainingRun.

It never imports torch, the evaluator or the trainer: the operator image is small and starts
fast, and everything GPU-related happens in the worker pods it creates.
"""

from kernelfleet.core.resources import GROUP, VERSION

__all__ = ["GROUP", "VERSION"]
