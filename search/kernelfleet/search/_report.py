"""Reading a run back from the store: the results table, the best code, the HTML report.

Everything here reads; nothing writes to the store. A task that is done has a summary, whose
speedup was re-verified; a task still running (or killed) is shown from its results so far,
marked as not yet verified. The HTML report is one self-contained file: inline SVG plots, no
scripts, no external style sheets, so it can be attached to a ticket or opened offline.
"""

from __future__ import annotations

import html
import logging
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kernelfleet.core.errors import UsageError
from kernelfleet.core.models import BUDGET_STOPS, EvaluationResult, Task, TaskSummary, Verdict
from kernelfleet.core.store import CorruptObject, Store
from kernelfleet.search._layout import (
    RunLayout,
    RunManifest,
    code_damage,
    iter_samples,
    latest_summaries,
    load_tasks_of_run,
    read_model,
    summary_damage,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeedupStats:
    count: int
    mean: float | None
    median: float | None
    geomean: float | None
    improved: int  # more than 1% faster

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "count": self.count,
            "mean": self.mean,
            "median": self.median,
            "geomean": self.geomean,
            "improved_over_1pct": self.improved,
        }


def speedup_stats(values: Iterable[float | None]) -> SpeedupStats:
    """Mean, median, geometric mean, and how many exceed 1.01x. A missing value counts as 1.0:
    a task without a verified variant keeps its reference, which is what a user would run. When
    no task has a value there is nothing to average: the figures are None, not 1.0x."""
    given = list(values)
    speedups = [value if value is not None and value > 0 else 1.0 for value in given]
    if not any(value is not None and value > 0 for value in given):
        return SpeedupStats(len(given), None, None, None, 0)
    geomean = math.exp(sum(math.log(value) for value in speedups) / len(speedups))
    return SpeedupStats(
        count=len(speedups),
        mean=statistics.fmean(speedups),
        median=statistics.median(speedups),
        geomean=geomean,
        improved=sum(1 for value in speedups if value > 1.01),
    )


@dataclass(frozen=True)
class TaskOutcome:
    """One task on one GPU class, done or not."""

    task: Task
    gpu_class: str
    summary: TaskSummary | None
    results: tuple[EvaluationResult, ...] = ()
    attribution: dict[str, tuple[str, str]] = field(default_factory=dict)  # variant -> (policy, name)
    best_code: str | None = None
    # What of the task's record the store no longer backs (a damaged or missing result, code or
    # verification): then no speedup and no code is shown, and `status` says what to run.
    damage: str = ""

    @property
    def done(self) -> bool:
        return self.summary is not None

    @property
    def _best_result(self) -> EvaluationResult | None:
        correct = [r for r in self.results if r.verdict == Verdict.CORRECT and r.speedup is not None]
        return max(correct, key=lambda r: (r.speedup or 0.0, r.variant_hash)) if correct else None

    @property
    def best_speedup(self) -> float | None:
        if self.damage:
            return None
        if self.summary is not None:
            return self.summary.best_speedup
        best = self._best_result
        return best.speedup if best else None

    @property
    def best_variant_hash(self) -> str | None:
        if self.summary is not None:
            return self.summary.best_variant_hash
        best = self._best_result
        return best.variant_hash if best else None

    @property
    def best_policy(self) -> str:
        if self.summary is not None:
            return self.summary.best_policy or ""
        variant = self.best_variant_hash
        return self.attribution.get(variant, ("", ""))[0] if variant else ""

    @property
    def best_name(self) -> str:
        if self.summary is not None:
            return self.summary.best_name
        variant = self.best_variant_hash
        return self.attribution.get(variant, ("", ""))[1] if variant else ""

    @property
    def speedup_vs_compile(self) -> float | None:
        return self.summary.speedup_vs_compile if self.summary is not None and not self.damage else None

    @property
    def compile_over_eager(self) -> float | None:
        """How much faster torch.compile of the reference is than eager (the compile baseline)."""
        if self.summary is None:
            return None
        if self.summary.compile_speedup is not None:
            return self.summary.compile_speedup
        eager, compiled = self.summary.baselines.get("eager"), self.summary.baselines.get("compile")
        if eager is None or compiled is None or compiled.median_ms <= 0:
            return None
        return eager.median_ms / compiled.median_ms

    @property
    def verdicts(self) -> Counter[str]:
        if self.summary is not None:
            return Counter(self.summary.verdicts)
        return Counter(str(r.verdict) for r in self.results)

    @property
    def status(self) -> str:
        if self.damage:
            return f"DAMAGED: {self.damage}"
        if self.summary is None:
            return "running" if self.results else "pending"
        if self.summary.stop_reason in BUDGET_STOPS:
            # Stopping is not finishing: the same command continues it.
            return f"stopped ({self.summary.stop_reason}), not finished"
        if self.summary.best_speedup is None:
            return f"done ({self.summary.stop_reason}), nothing verified"
        return f"done ({self.summary.stop_reason})" + ("" if self.summary.verified else ", not re-verified")


@dataclass(frozen=True)
class RunReport:
    prefix: str
    store_url: str
    manifest: RunManifest | None
    outcomes: tuple[TaskOutcome, ...]
    # Objects that could not be read (corrupt), by message: the report is made without them.
    skipped: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.manifest.run_id if self.manifest else self.prefix

    def stats(self, gpu_class: str | None = None) -> SpeedupStats:
        return speedup_stats(
            outcome.best_speedup for outcome in self.outcomes if gpu_class in (None, outcome.gpu_class)
        )

    @property
    def gpu_classes(self) -> list[str]:
        return sorted({outcome.gpu_class for outcome in self.outcomes})


def list_runs(store: Store) -> list[str]:
    return [
        key[len("runs/") : -len("/run.json")]
        for key in store.list("runs/")
        if key.count("/") == 2 and key.endswith("/run.json")
    ]


def resolve_run(store: Store, run: str) -> str:
    """The store prefix of `run`: a local run id (`runs/<id>`) or any prefix holding a run."""
    run = run.strip().strip("/")
    if not run:
        raise UsageError("give a run id; `kernelfleet results` without one lists the runs in the store")
    for prefix in (f"runs/{run}", run):
        if store.exists(f"{prefix}/run.json") or next(iter(store.list(f"{prefix}/tasks/")), None) is not None:
            return prefix
    known = list_runs(store)
    hint = f"runs in {store.url}: {', '.join(known)}" if known else f"{store.url} holds no runs yet"
    raise UsageError(f"no run {run!r} in the store ({hint}); check the id or pass --store")


def load_run(store: Store, prefix: str, with_code: bool = True) -> RunReport:
    """Everything the table and the report show, read from the store.

    A corrupt object (a result, a summary, run.json, a variant...) is left out and named in
    `skipped`: one bad file must not make the rest of the run unreadable.
    """
    layout = RunLayout(prefix)
    skipped: dict[str, str] = {}
    damaged_results: set[str] = set()  # tasks (16 characters of the hash) with a damaged result

    def skip(error: CorruptObject) -> None:
        log.warning("%s", error)
        skipped.setdefault(error.key, str(error))
        if error.key.startswith(f"{layout.prefix}/results/"):
            damaged_results.add(error.key[len(layout.prefix) + len("/results/") :].split("/", 1)[0])

    manifest = read_model(store, layout.manifest, RunManifest, skip)
    results_by_task: dict[tuple[str, str], list[EvaluationResult]] = {}
    for result in store.list_results(layout.prefix, on_corrupt=skip):
        results_by_task.setdefault((result.task_hash, result.environment.gpu_class), []).append(result)
    tasks = load_tasks_of_run(store, layout, skip)
    summaries_by_task = {task.hash: latest_summaries(store, layout, task.hash, skip) for task in tasks}
    # A task not started yet is shown as pending on every device class the run has seen.
    run_classes = {gpu for (_, gpu) in results_by_task} | {
        gpu for summaries in summaries_by_task.values() for gpu in summaries
    }
    if manifest is not None and manifest.gpu_class:
        run_classes.add(manifest.gpu_class)
    outcomes = []
    for task in tasks:
        summaries = summaries_by_task[task.hash]
        classes = sorted(
            set(summaries) | {gpu for (task_hash, gpu) in results_by_task if task_hash == task.hash}
        )
        for gpu_class in classes or sorted(run_classes) or ["-"]:
            summary = summaries.get(gpu_class)
            results = tuple(results_by_task.get((task.hash, gpu_class), ()))
            attribution: dict[str, tuple[str, str]] = {}
            if summary is None:
                for record in iter_samples(store, layout, task.hash, gpu_class, skip):
                    if record.variant_hash and record.variant_hash not in attribution:
                        attribution[record.variant_hash] = (record.policy, record.name)
            outcome = TaskOutcome(task, gpu_class, summary, results, attribution)
            best = outcome.best_variant_hash
            if summary is not None:
                by_variant = {r.variant_hash: r for r in results}
                damaged = task.hash[:16] in damaged_results
                damage = summary_damage(store, layout, summary, by_variant, damaged, skip)
            else:
                damage = code_damage(store, best, skip) if best else ""
            code = None
            if with_code and best and not damage:
                code = store.get_variant(best)
            outcomes.append(TaskOutcome(task, gpu_class, summary, results, attribution, code, damage))
    return RunReport(
        prefix=layout.prefix,
        store_url=store.url,
        manifest=manifest,
        outcomes=tuple(outcomes),
        skipped=tuple(skipped.values()),
    )


# ---------------------------------------------------------------------- text


def _times(value: float | None, mark: str = "") -> str:
    return f"{value:.2f}x{mark}" if value is not None else "-"


def format_table(outcomes: Sequence[TaskOutcome]) -> str:
    """The per-task table printed at the end of `optimize` and by `results`."""
    header = ("task", "gpu", "vs eager", "vs compile", "policy", "variant", "correct", "status")
    rows = []
    for outcome in outcomes:
        unverified = (
            "*"
            if outcome.best_speedup is not None and not (outcome.summary and outcome.summary.verified)
            else ""
        )
        verdicts = outcome.verdicts
        rows.append(
            (
                outcome.task.name,
                outcome.gpu_class,
                _times(outcome.best_speedup, unverified),
                _times(outcome.speedup_vs_compile),
                outcome.best_policy or "-",
                outcome.best_name or (outcome.best_variant_hash or "-")[:12],
                f"{verdicts.get('correct', 0)}/{sum(verdicts.values())}",
                outcome.status,
            )
        )
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    right = {2, 3, 6}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(cell).rjust(widths[i]) if i in right else str(cell).ljust(widths[i])
            for i, cell in enumerate(cells)
        ).rstrip()

    out = [line(header), line(["-" * width for width in widths])]
    out.extend(line(row) for row in rows)
    stats = speedup_stats(outcome.best_speedup for outcome in outcomes)
    missing = sum(1 for outcome in outcomes if outcome.best_speedup is None)
    if stats.geomean is not None and stats.median is not None and stats.mean is not None:
        out.append("")
        out.append(
            f"{stats.count} task(s): geomean {stats.geomean:.2f}x, median {stats.median:.2f}x, "
            f"mean {stats.mean:.2f}x over eager; {stats.improved} improved by more than 1%"
            + (f" ({missing} without a verified variant counted as 1.00x)" if missing else "")
        )
    elif stats.count:
        out.append("")
        out.append(f"{stats.count} task(s), none with a verified variant yet: no speedup to summarise")
    if any(
        outcome.best_speedup is not None and not (outcome.summary and outcome.summary.verified)
        for outcome in outcomes
    ):
        out.append("* not yet re-verified (the task is still running, or was stopped before it finished)")
    return "\n".join(out)


def format_best_code(outcomes: Sequence[TaskOutcome]) -> str:
    parts = []
    for outcome in outcomes:
        if outcome.damage:
            parts.append(
                f"# ==== {outcome.task.name} on {outcome.gpu_class}: no code shown: {outcome.damage} ====\n"
            )
            continue
        if outcome.best_code is None:
            continue
        parts.append(
            f"# ==== {outcome.task.name} on {outcome.gpu_class}: {_times(outcome.best_speedup)} over eager "
            f"by {outcome.best_policy or '?'} ({outcome.best_variant_hash}) ====\n"
            f"{outcome.best_code.rstrip()}\n"
        )
    return "\n".join(parts)


# ---------------------------------------------------------------------- HTML

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:72rem;
color:#1b1f24;padding:0 1rem}
h1{font-size:1.5rem}h2{font-size:1.15rem;margin-top:2rem}
table{border-collapse:collapse;width:100%;font-size:.9rem}
th,td{padding:.3rem .6rem;border-bottom:1px solid #ddd;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.good{color:#1a7f37}.bad{color:#cf222e}.muted{color:#656d76}
pre{background:#f6f8fa;padding:.8rem;overflow-x:auto;font-size:.8rem}
details{margin:.4rem 0}summary{cursor:pointer}
.stats span{display:inline-block;margin-right:1.5rem}
"""


def _tick(exponent: int) -> str:
    value = 2.0**exponent
    return f"{value:g}x" if exponent >= 0 else f"1/{2**-exponent}x"


def _log2_axis(values: Sequence[float]) -> tuple[float, float]:
    logs = [math.log2(value) for value in values if value > 0] + [0.0]
    low, high = math.floor(min(logs)), math.ceil(max(logs))
    if high - low < 2:
        low, high = low - 1, high + 1
    return float(low), float(high)


def _bars_svg(outcomes: Sequence[TaskOutcome]) -> str:
    """Per task: the best variant and torch.compile, as speedups over eager on a log scale."""
    rows = [
        (
            o.task.name + ("" if len({x.gpu_class for x in outcomes}) == 1 else f" [{o.gpu_class}]"),
            o.best_speedup,
            o.compile_over_eager,
        )
        for o in outcomes
    ]
    values = [v for _, best, comp in rows for v in (best, comp) if v is not None and v > 0]
    if not rows or not values:
        return '<p class="muted">No measured speedups yet.</p>'
    low, high = _log2_axis(values)
    label_w, plot_w, bar_h, gap = 220, 560, 12, 10
    row_h = 2 * bar_h + gap
    height = 60 + row_h * len(rows)
    width = label_w + plot_w + 70

    def x(value: float) -> float:
        return label_w + (math.log2(value) - low) / (high - low) * plot_w

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        'aria-label="speedup per task" font-size="11" font-family="sans-serif">'
    ]
    for tick in range(int(low), int(high) + 1):
        tx = x(2.0**tick)
        parts.append(f'<line x1="{tx:.1f}" y1="20" x2="{tx:.1f}" y2="{height - 25}" stroke="#ddd"/>')
        parts.append(f'<text x="{tx:.1f}" y="14" text-anchor="middle" fill="#656d76">{_tick(tick)}</text>')
    one = x(1.0)
    legend_y = height - 8
    parts.append(f'<rect x="{label_w}" y="{legend_y - 9}" width="10" height="10" fill="#2da44e"/>')
    parts.append(f'<text x="{label_w + 14}" y="{legend_y}">best variant (red: slower than eager)</text>')
    parts.append(f'<rect x="{label_w + 250}" y="{legend_y - 9}" width="10" height="10" fill="#8c959f"/>')
    parts.append(f'<text x="{label_w + 264}" y="{legend_y}">torch.compile of the reference</text>')
    for index, (name, best, compiled) in enumerate(rows):
        top = 25 + index * row_h
        parts.append(
            f'<text x="{label_w - 8}" y="{top + bar_h + 4}" text-anchor="end">{html.escape(name[:34])}</text>'
        )
        for offset, value, color, label in (
            (0, best, "#2da44e" if (best or 0) >= 1 else "#cf222e", "best"),
            (bar_h, compiled, "#8c959f", "torch.compile"),
        ):
            if value is None or value <= 0:
                continue
            start, end = sorted((one, x(value)))
            parts.append(
                f'<rect x="{start:.1f}" y="{top + offset}" width="{max(end - start, 1):.1f}" '
                f'height="{bar_h - 2}" fill="{color}"><title>{label}: {value:.3f}x</title></rect>'
            )
            parts.append(
                f'<text x="{max(end, one) + 4:.1f}" y="{top + offset + bar_h - 3}" '
                f'fill="#1b1f24">{value:.2f}x</text>'
            )
    parts.append(f'<line x1="{one:.1f}" y1="20" x2="{one:.1f}" y2="{height - 25}" stroke="#1b1f24"/>')
    parts.append("</svg>")
    return "".join(parts)


def _histogram_svg(speedups: Sequence[float]) -> str:
    """How the speedups of every correct variant are distributed, in bins of a quarter octave."""
    values = [value for value in speedups if value > 0]
    if not values:
        return '<p class="muted">No correct variants yet.</p>'
    low, high = _log2_axis(values)
    bins_per_octave = 4
    count = int((high - low) * bins_per_octave)
    counts = [0] * count
    for value in values:
        position = int((math.log2(value) - low) * bins_per_octave)
        counts[min(max(position, 0), count - 1)] += 1
    plot_w, plot_h, left, top = 640, 180, 40, 15
    width, height = left + plot_w + 20, top + plot_h + 35
    peak = max(counts)
    bar_w = plot_w / count
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        'aria-label="speedup distribution" font-size="11" font-family="sans-serif">'
    ]
    for index, number in enumerate(counts):
        if not number:
            continue
        bar_h = number / peak * plot_h
        lo = 2.0 ** (low + index / bins_per_octave)
        color = "#2da44e" if lo >= 1 else "#cf222e"
        parts.append(
            f'<rect x="{left + index * bar_w + 1:.1f}" y="{top + plot_h - bar_h:.1f}" '
            f'width="{bar_w - 2:.1f}" height="{bar_h:.1f}" fill="{color}">'
            f"<title>{lo:.2f}x-{lo * 2 ** (1 / bins_per_octave):.2f}x: {number}</title></rect>"
        )
    for tick in range(int(low), int(high) + 1):
        tx = left + (tick - low) * bins_per_octave * bar_w
        base = top + plot_h
        parts.append(f'<line x1="{tx:.1f}" y1="{base}" x2="{tx:.1f}" y2="{base + 4}" stroke="#656d76"/>')
        parts.append(
            f'<text x="{tx:.1f}" y="{base + 16}" text-anchor="middle" fill="#656d76">{_tick(tick)}</text>'
        )
    parts.append(f'<text x="{left}" y="{top - 3}" fill="#656d76">variants (max {peak} per bin)</text>')
    parts.append(
        f'<text x="{left + plot_w / 2:.0f}" y="{height - 2}" text-anchor="middle" fill="#656d76">'
        "speedup over the eager reference</text>"
    )
    parts.append("</svg>")
    return "".join(parts)


def render_html(report: RunReport) -> str:
    """The self-contained HTML report of a run."""
    esc = html.escape
    stats = report.stats()
    all_speedups = [
        r.speedup
        for o in report.outcomes
        for r in o.results
        if r.verdict == Verdict.CORRECT and r.speedup is not None
    ]
    verdicts: Counter[str] = Counter()
    for outcome in report.outcomes:
        verdicts.update(outcome.verdicts)
    stat_html = "".join(
        f"<span><b>{esc(label)}</b> {esc(value)}</span>"
        for label, value in (
            ("tasks", str(stats.count)),
            ("geomean", _times(stats.geomean)),
            ("median", _times(stats.median)),
            ("mean", _times(stats.mean)),
            ("improved >1%", str(stats.improved)),
            ("variants", str(sum(verdicts.values()))),
            ("verdicts", ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())) or "-"),
        )
    )
    rows = []
    for o in report.outcomes:
        best = o.best_speedup
        cls = (
            "good" if best is not None and best > 1.01 else "bad" if best is not None and best < 0.99 else ""
        )
        counts = o.verdicts
        rows.append(
            "<tr>"
            f"<td>{esc(o.task.name)}</td><td>{esc(o.gpu_class)}</td>"
            f'<td class="num {cls}">{_times(best)}</td><td class="num">{_times(o.speedup_vs_compile)}</td>'
            f'<td class="num">{_times(o.compile_over_eager)}</td>'
            f"<td>{esc(o.best_policy or '-')}</td>"
            f"<td>{esc(o.best_name or (o.best_variant_hash or '-')[:12])}</td>"
            f'<td class="num">{counts.get("correct", 0)}/{sum(counts.values())}</td><td>{esc(o.status)}</td>'
            "</tr>"
        )
    code_blocks = []
    for o in report.outcomes:
        if o.best_code is None:
            continue
        code_blocks.append(
            f"<details><summary>{esc(o.task.name)} on {esc(o.gpu_class)}: {_times(o.best_speedup)} by "
            f"{esc(o.best_policy or '?')} "
            f'<span class="muted">{esc(o.best_variant_hash or "")}</span></summary>'
            f"<pre><code>{esc(o.best_code)}</code></pre></details>"
        )
    policies = ", ".join(report.manifest.policies) if report.manifest else "-"
    damaged = [o for o in report.outcomes if o.damage]
    damage_html = (
        '<p class="bad"><b>Damaged in the store</b> (no speedup or code shown; run the optimize '
        "command that made this run again to repair it, and <code>kernelfleet store verify</code> for "
        "details): "
        + "; ".join(f"{esc(o.task.name)} on {esc(o.gpu_class)}: {esc(o.damage)}" for o in damaged)
        + "</p>"
        if damaged
        else ""
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kernelfleet run {esc(report.name)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_STYLE}</style></head>
<body>
<h1>kernelfleet run {esc(report.name)}</h1>
<p class="muted">store {esc(report.store_url)} &middot; prefix {esc(report.prefix)}
&middot; policies {esc(policies)} &middot; device classes {esc(", ".join(report.gpu_classes) or "-")}</p>
<p class="stats">{stat_html}</p>
{damage_html}
<p class="muted">Speedups are over the eager PyTorch reference, measured by the kernelfleet evaluator;
a finished task's best variant was re-measured in a fresh process.
Tasks without a verified variant count as 1.0x.</p>
<h2>Per task: best variant and torch.compile, over eager</h2>
{_bars_svg(report.outcomes)}
<h2>Speedup distribution of all correct variants</h2>
{_histogram_svg(all_speedups)}
<h2>Results</h2>
<table><thead><tr><th>task</th><th>gpu</th><th>best vs eager</th><th>vs compile</th><th>compile vs eager</th>
<th>policy</th><th>variant</th><th>correct</th><th>status</th></tr></thead>
<tbody>{"".join(rows)}</tbody></table>
<h2>Best code per task</h2>
{"".join(code_blocks) or '<p class="muted">No verified variant yet.</p>'}
</body></html>
"""
