"""Does the evaluation find the build pool's build? A diagnostic for the GPU machine.

For each published kernel of the given tasks that builds C++/CUDA: the build pool's build
(seconds), what ninja would still do in each build directory right after it
(`ninja -d explain -n`), then the evaluation's seconds per stage, and what the evaluation
changed in the build directories (build.ninja, new directories). A `candidate_load` or
`correctness` of many seconds with a changed build directory is a compile the build pool did
not save.

    python benchmarks/build_reuse.py --kernels K.jsonl --tasks 1:10,1:26 [--device cuda]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "core"), str(ROOT / "evaluator"), str(ROOT / "benchmarks")]

from reward_service import is_native, load_workload  # noqa: E402

from kernelfleet.evaluator import EvalConfig, Evaluator  # noqa: E402
from kernelfleet.evaluator._evaluator import _Item  # noqa: E402


def build_dirs(root: Path) -> dict[Path, str]:
    """Every directory holding a build.ninja, with that file's text."""
    return {p.parent: p.read_text(encoding="utf-8") for p in root.rglob("build.ninja")}


def explain(directory: Path) -> str:
    ninja = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
    done = subprocess.run(
        [ninja, "-d", "explain", "-n", "-C", str(directory)], capture_output=True, text=True, check=False
    )
    return (done.stdout + done.stderr).strip()[-3000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=Path, required=True)
    parser.add_argument("--tasks", required=True, help="comma list of LEVEL:ID")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    wanted = set(args.tasks.split(","))
    rows = [r for r in load_workload(args.kernels, "kernelbench-v0") if r[2] in wanted and is_native(r[1])]
    root = Path(tempfile.mkdtemp(prefix="kf-build-reuse-"))
    config = EvalConfig(
        device=args.device, profile="kernelbench-v0", cache_dir=str(root), speedup_recheck=None
    )
    with Evaluator(config) as evaluator:
        lane = evaluator._probe_lanes()[0]
        for task, code, name in rows:
            item = _Item(task, code, config, concurrent.futures.Future())
            failed = evaluator._build(item, lane)
            before = build_dirs(root)
            seconds = item.stages.get("build", 0.0)
            print(f"== {name}: build {seconds:.1f} s, failed: {failed and failed.reasons}")
            for directory in before:
                print(f"-- ninja after the build, {directory.relative_to(root)}:\n{explain(directory)}")
            result = evaluator.evaluate(task, code)
            stages = {k: round(v, 1) for k, v in result.stages.items()}
            print(f"-- evaluation: {result.verdict} {json.dumps(stages)}")
            after = build_dirs(root)
            for directory, text in after.items():
                if directory not in before:
                    print(f"-- new build directory {directory.relative_to(root)}")
                elif before[directory] != text:
                    old, new = before[directory].splitlines(), text.splitlines()
                    changed = [f"- {a}\n+ {b}" for a, b in zip(old, new, strict=False) if a != b]
                    where = directory.relative_to(root)
                    print(f"-- build.ninja changed in {where}:\n" + "\n".join(changed[:8]))
                log = directory / ".ninja_log"
                if log.exists():
                    print(f"-- .ninja_log tail:\n{log.read_text(encoding='utf-8')[-600:]}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
