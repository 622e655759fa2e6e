"""`kernelfleet status`: where jobs and runs stand, read from their status (never the store).

The list shows what a user scans for: phase, tasks done of total, best and median speedup per
GPU class, conditions that need attention, and age. One resource adds its per-class table,
its verification, every condition, and its recent Events. The formatting is pure (resources in,
text out), so it is tested without a cluster.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from typing import Any

# Conditions whose True means trouble, and those whose False does (metav1.Condition style).
ATTENTION_WHEN_TRUE = ("Failed", "ReconcileError", "GpuClassUnavailable", "Degraded", "Stalled")
ATTENTION_WHEN_FALSE = ("Accepted", "Ready", "StoreReachable")
# How long a new resource may go without any status before the operator is suspected missing.
OPERATOR_GRACE_S = 30.0


def parse_time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def age(text: str | None, now: datetime.datetime | None = None) -> str:
    """kubectl's style: 45s, 12m, 5h, 3d."""
    then = parse_time(text)
    if then is None:
        return "-"
    seconds = max(0, int(((now or datetime.datetime.now(datetime.UTC)) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def speedup(value: Any) -> str:
    return "-" if value is None else f"{float(value):.2f}x"


def attention(resource: dict[str, Any], now: datetime.datetime | None = None) -> list[str]:
    """Short notes on what needs a look: failing conditions, or no operator having seen it."""
    status = resource.get("status") or {}
    notes = []
    for condition in status.get("conditions") or []:
        kind, value = condition.get("type", ""), condition.get("status")
        if (kind in ATTENTION_WHEN_TRUE and value == "True") or (
            kind in ATTENTION_WHEN_FALSE and value == "False"
        ):
            reason = condition.get("reason") or kind
            notes.append(f"{kind}: {reason}" if reason != kind else kind)
    if not not_picked_up(resource, now):
        return notes
    return [
        *notes,
        f"no operator has picked it up in {age(resource['metadata'].get('creationTimestamp'), now)}",
    ]


def not_picked_up(resource: dict[str, Any], now: datetime.datetime | None = None) -> bool:
    """True when the resource is older than the grace period and has no status at all."""
    status = resource.get("status") or {}
    if status.get("phase") or status.get("observedGeneration") or status.get("conditions"):
        return False
    created = parse_time(resource["metadata"].get("creationTimestamp"))
    if created is None:
        return False
    elapsed = ((now or datetime.datetime.now(datetime.UTC)) - created).total_seconds()
    return elapsed > OPERATOR_GRACE_S


def progress(resource: dict[str, Any]) -> str:
    """Tasks done of total (OptimizationJob) or stages done of total (TrainingRun)."""
    status = resource.get("status") or {}
    if resource["kind"] == "TrainingRun":
        total = len((resource.get("spec") or {}).get("stages") or [])
        return f"{status.get('stagesDone', 0)}/{total} stages"
    failed = status.get("tasksFailed") or 0
    text = f"{status.get('tasksDone', 0)}/{status.get('tasksTotal', 0)}"
    return f"{text} ({failed} failed)" if failed else text


def per_class_speedups(resource: dict[str, Any]) -> str:
    status = resource.get("status") or {}
    if resource["kind"] == "TrainingRun":
        return status.get("currentStage") or "-"
    classes = status.get("perClass") or {}
    if not classes:
        return "-"
    return ", ".join(
        f"{name} {speedup(c.get('bestSpeedup'))}/{speedup(c.get('medianSpeedup'))}"
        for name, c in sorted(classes.items())
    )


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def format_list(
    resources: Iterable[dict[str, Any]], all_namespaces: bool, now: datetime.datetime | None = None
) -> str:
    header = ["NAME", "KIND", "PHASE", "TASKS", "BEST/MEDIAN BY CLASS", "ATTENTION", "AGE"]
    rows = [(["NAMESPACE"] if all_namespaces else []) + header]
    for resource in resources:
        meta, status = resource["metadata"], resource.get("status") or {}
        row = [
            meta["name"],
            resource["kind"],
            status.get("phase") or "-",
            progress(resource),
            per_class_speedups(resource),
            "; ".join(attention(resource, now)) or "-",
            age(meta.get("creationTimestamp"), now),
        ]
        rows.append(([meta.get("namespace", "")] if all_namespaces else []) + row)
    return table(rows)


def format_detail(
    resource: dict[str, Any], events: Sequence[dict[str, Any]] = (), now: datetime.datetime | None = None
) -> str:
    meta, status = resource["metadata"], resource.get("status") or {}
    kind = resource["kind"]
    lines = [
        f"{kind} {meta.get('namespace')}/{meta['name']}: {status.get('phase') or 'no status yet'}, "
        f"age {age(meta.get('creationTimestamp'), now)}, generation {meta.get('generation', '-')} "
        f"(observed {status.get('observedGeneration', '-')})"
    ]
    if kind == "OptimizationJob":
        lines.append(
            f"tasks: {status.get('tasksDone', 0)} of {status.get('tasksTotal', 0)} done, "
            f"{status.get('tasksFailed', 0)} failed; "
            f"{status.get('variantsEvaluated', 0)} variants evaluated; "
            f"best {speedup(status.get('bestSpeedup'))}, median {speedup(status.get('medianSpeedup'))}"
        )
        if status.get("results"):
            hint = f"kernelfleet results {meta['name']} -n {meta.get('namespace')}"
            lines.append(f"results: {status['results']}  ({hint})")
        classes = status.get("perClass") or {}
        if classes:
            rows = [["CLASS", "DONE/TOTAL", "FAILED", "VARIANTS", "BEST", "MEDIAN", "JOBS", "ACTIVE PODS"]]
            for name, c in sorted(classes.items()):
                rows.append(
                    [
                        name,
                        f"{c.get('tasksDone', 0)}/{c.get('tasksTotal', 0)}",
                        str(c.get("tasksFailed", 0)),
                        str(c.get("variantsEvaluated", 0)),
                        speedup(c.get("bestSpeedup")),
                        speedup(c.get("medianSpeedup")),
                        str(c.get("jobs", 0)),
                        str(c.get("activePods", 0)),
                    ]
                )
            lines += ["", table(rows)]
        verification = status.get("verification") or {}
        if verification:
            rows = [["VERIFIED ON", "DONE/TOTAL", "STILL CORRECT", "MEDIAN SPEEDUP", "MEDIAN RATIO"]]
            for name, v in sorted(verification.items()):
                ratio = v.get("medianRatio")
                rows.append(
                    [
                        name,
                        f"{v.get('tasksDone', 0)}/{v.get('tasksTotal', 0)}",
                        str(v.get("verified", 0)),
                        speedup(v.get("medianSpeedup")),
                        "-" if ratio is None else f"{float(ratio):.2f}",
                    ]
                )
            lines += ["", table(rows)]
    else:
        stages = status.get("stages") or []
        if stages:
            rows = [["STAGE", "TYPE", "PHASE", "STEP", "CHECKPOINT"]]
            for stage in stages:
                step = f"{stage.get('step', 0)}/{stage.get('maxSteps', 0) or '?'}"
                rows.append(
                    [
                        stage.get("name", ""),
                        stage.get("type", ""),
                        stage.get("phase", ""),
                        step,
                        stage.get("checkpoint") or "-",
                    ]
                )
            lines += ["", table(rows)]
    conditions = status.get("conditions") or []
    if conditions:
        rows = [["CONDITION", "STATUS", "REASON", "AGE", "MESSAGE"]]
        for c in conditions:
            rows.append(
                [
                    c.get("type", ""),
                    c.get("status", ""),
                    c.get("reason", ""),
                    age(c.get("lastTransitionTime"), now),
                    c.get("message", ""),
                ]
            )
        lines += ["", table(rows)]
    notes = [note for note in attention(resource, now) if note.startswith("no operator")]
    if notes:
        lines += [
            "",
            f"attention: {notes[0]}: is the operator running? `kubectl get deploy -A -l "
            "app.kubernetes.io/name=kernelfleet` shows it; its log says why it skips this namespace",
        ]
    if events:
        rows = [["AGE", "TYPE", "REASON", "MESSAGE"]]
        for event in events[-10:]:
            when = (
                event.get("lastTimestamp")
                or event.get("eventTime")
                or event["metadata"].get("creationTimestamp")
            )
            rows.append(
                [age(when, now), event.get("type", ""), event.get("reason", ""), event.get("message", "")]
            )
        lines += ["", "recent events:", table(rows)]
    return "\n".join(lines)


def events_of(cluster: Any, resource: dict[str, Any]) -> list[dict[str, Any]]:
    """The Events about `resource`, oldest first."""
    meta = resource["metadata"]
    answer = cluster.core.list_namespaced_event(
        meta["namespace"], field_selector=f"involvedObject.uid={meta['uid']}", _preload_content=False
    )
    import json

    items: list[dict[str, Any]] = json.loads(answer.data).get("items", [])

    def when(event: dict[str, Any]) -> str:
        return str(
            event.get("lastTimestamp")
            or event.get("eventTime")
            or event["metadata"].get("creationTimestamp")
            or ""
        )

    return sorted(items, key=when)
