"""OptimizationJob: the kopf handlers (work in progress: reconciliation lands next)."""

from __future__ import annotations
