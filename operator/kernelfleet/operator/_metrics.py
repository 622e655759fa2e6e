"""Prometheus metrics of the operator, in the text exposition format, served by aiohttp.

kopf has no metrics of its own. The few the operator needs (reconciles, errors, jobs by phase,
status patches, API requests) are kept here in plain counters and gauges; writing the text
format by hand avoids a dependency for forty lines of code.

    kernelfleet_operator_reconciles_total{kind="OptimizationJob"} 12
    kernelfleet_operator_jobs{kind="OptimizationJob",phase="Running"} 3
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable

from aiohttp import web

LabelSet = tuple[tuple[str, str], ...]


def _labels(labels: dict[str, str]) -> LabelSet:
    return tuple(sorted(labels.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    """Counters and gauges by name and labels; `collectors` add values computed at scrape time."""

    def __init__(self, prefix: str = "kernelfleet_operator") -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._counters: dict[str, dict[LabelSet, float]] = defaultdict(dict)
        self._gauges: dict[str, dict[LabelSet, float]] = defaultdict(dict)
        self._help: dict[str, str] = {}
        self.collectors: list[Callable[[Metrics], None]] = []

    def describe(self, name: str, text: str) -> None:
        self._help[name] = text

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        with self._lock:
            series = self._counters[name]
            key = _labels(labels)
            series[key] = series.get(key, 0.0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._gauges[name][_labels(labels)] = value

    def replace_gauge(self, name: str, values: Iterable[tuple[dict[str, str], float]]) -> None:
        """Set a gauge's whole series at once (series not given disappear)."""
        with self._lock:
            self._gauges[name] = {_labels(labels): value for labels, value in values}

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            key = _labels(labels)
            return self._counters.get(name, {}).get(key, self._gauges.get(name, {}).get(key, 0.0))

    def render(self) -> str:
        for collect in self.collectors:
            collect(self)
        lines: list[str] = []
        with self._lock:
            for kind, table in (("counter", self._counters), ("gauge", self._gauges)):
                for name in sorted(table):
                    full = f"{self.prefix}_{name}"
                    if name in self._help:
                        lines.append(f"# HELP {full} {self._help[name]}")
                    lines.append(f"# TYPE {full} {kind}")
                    for labels, value in sorted(table[name].items()):
                        text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                        lines.append(f"{full}{{{text}}} {value:g}" if text else f"{full} {value:g}")
        return "\n".join(lines) + "\n"


async def serve(metrics: Metrics, host: str, port: int) -> web.AppRunner:
    """Start the /metrics endpoint; the caller keeps the runner and cleans it up at shutdown."""

    async def handle(_: web.Request) -> web.Response:
        return web.Response(text=metrics.render(), content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
