"""The cluster path on the command line: `dev-cluster`, `submit`, `status` and `logs`.

These are commands of the operator distribution (no torch): a user's laptop with only
`kernelfleet-operator` installed can start a dev cluster, submit jobs and follow them. Parsers
are built here; each handler imports what it needs when it runs, so `kernelfleet --help` stays
fast and never loads the Kubernetes client.
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from kernelfleet.core.options import ModelOptions
from kernelfleet.core.resources import OptimizationJobSpec, PolicySpec

# Fields of the job spec that are plain flags of `submit`, when the spec has them. The flags
# are generated from a model holding just these fields (same types, defaults and help), since
# the spec itself cannot validate one field alone (it requires `tasks`).
_SPEC_FLAGS = (
    "parallelism",
    "gpus_per_pod",
    "tasks_per_index",
    "queue_name",
    "priority_class_name",
    "backoff_limit_per_index",
    "ttl_seconds_after_finished",
    "active_deadline_seconds",
)
JobFlags: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "JobFlags",
    __config__=ConfigDict(extra="forbid", populate_by_name=True),
    **{
        name: (info.annotation, info)
        for name, info in OptimizationJobSpec.model_fields.items()
        if name in _SPEC_FLAGS
    },
)
SPEC_OPTIONS = ModelOptions(JobFlags, title="the cluster job")
# The language-model options of `optimize` that a job's policies carry.
POLICY_SPEC_OPTIONS = ModelOptions(
    PolicySpec, only=["temperature", "concurrency"], title="language-model policies (openai, hf, vllm)"
)


def _lazy(module: str, function: str) -> Any:
    def handler(args: argparse.Namespace) -> int:
        import importlib

        result: int = getattr(importlib.import_module(module), function)(args)
        return result

    return handler


def _add_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        default=None,
        metavar="DIR",
        help="where the cluster keeps its state and data (default: $KERNELFLEET_DEV_CLUSTER_DIR or "
        "~/.cache/kernelfleet/dev-cluster)",
    )


def register_dev_cluster(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "dev-cluster",
        help="a Kubernetes cluster with fake GPU nodes and a store, on this machine",
        description="Run the cluster path without a cluster: a real control plane (etcd, kube-apiserver, "
        "scheduler, controller-manager), kwok nodes in four GPU pools (a100, h100, l40, rtx3090) and "
        "MinIO, built from their Go modules into kernelfleet's cache on first use.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="start the cluster (build the servers first if needed)")
    _add_dir(up)
    up.add_argument(
        "--kwok-nodes-per-pool",
        type=int,
        default=0,
        help="kwok nodes per GPU pool, which complete pods without running them (default: 0)",
    )
    up.add_argument("--no-operator", action="store_true", help="leave out the operator and the pod runner")
    up.add_argument(
        "--kueue",
        action="store_true",
        help="also run Kueue (built on first use), with a ClusterQueue of 8 GPUs per pool and a LocalQueue "
        "'kernelfleet' in namespace default (submit with --queue-name kernelfleet)",
    )
    up.add_argument("--no-build", action="store_true", help="fail instead of building missing servers")
    up.set_defaults(handler=_lazy("kernelfleet.operator.devcluster._commands", "up"))
    down = actions.add_parser("down", help="stop the cluster")
    _add_dir(down)
    down.add_argument("--purge", action="store_true", help="also delete the store's data")
    down.set_defaults(handler=_lazy("kernelfleet.operator.devcluster._commands", "down"))
    env = actions.add_parser("env", help="print the exports that point kubectl and kernelfleet at it")
    _add_dir(env)
    env.set_defaults(handler=_lazy("kernelfleet.operator.devcluster._commands", "env"))
    check = actions.add_parser("check", help="say what is built, running and healthy")
    _add_dir(check)
    check.set_defaults(handler=_lazy("kernelfleet.operator.devcluster._commands", "check"))
    demo = actions.add_parser(
        "demo", help="up, submit a small job on the example tasks, follow it, print its results, down"
    )
    _add_dir(demo)
    demo.add_argument("--gpu-class", default="h100", help="the pool to run on (default: h100)")
    demo.add_argument("--keep", action="store_true", help="leave the cluster running afterwards")
    demo.add_argument("--no-build", action="store_true", help="fail instead of building missing servers")
    demo.set_defaults(handler=_lazy("kernelfleet.operator.devcluster._commands", "demo"))


def register_status(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "status",
        help="where OptimizationJobs and TrainingRuns stand on the cluster",
        description="Without NAME: a table of the jobs and runs of a namespace (phase, tasks done of total, "
        "best/median speedup per GPU class, conditions that need attention, age). With NAME: its per-class "
        "table, conditions and recent Events.",
    )
    parser.add_argument("name", nargs="?", metavar="NAME")
    parser.add_argument("-n", "--namespace", default=None, help="default: the kubeconfig context's")
    parser.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    parser.set_defaults(handler=_lazy("kernelfleet.operator.client._commands", "status"))


def register_logs(subcommands: argparse._SubParsersAction) -> None:
    from kernelfleet.core.run_location import add_location_flags

    parser = subcommands.add_parser(
        "logs",
        help="the worker log lines of an OptimizationJob's tasks, from the store",
        description="Without --task: the tasks that have logs. With --task: their lines, as the worker "
        "pods wrote them to the store (there even after the pods are gone).",
    )
    parser.add_argument("name", metavar="NAME", help="the OptimizationJob")
    parser.add_argument("--task", default=None, help="a task name (or its start, or the start of its hash)")
    parser.add_argument(
        "--class", dest="gpu_class", default=None, metavar="GPU_CLASS", help="only this class"
    )
    add_location_flags(parser)
    parser.set_defaults(handler=_lazy("kernelfleet.operator.client._commands", "logs"))


def register_submit(subcommands: argparse._SubParsersAction) -> None:
    from kernelfleet.core.job_options import BUDGET_OPTIONS, EVALUATION_OPTIONS

    parser = subcommands.add_parser(
        "submit",
        help="run an optimisation on the cluster: `optimize`'s flags, as an OptimizationJob",
        description="Turn TASKS and the flags of `kernelfleet optimize` into an OptimizationJob (local task "
        "and replay files are uploaded to the store first), or create the OptimizationJobs and TrainingRuns "
        "of a manifest file (-f). Prints each resource's name; --wait follows it to the end and prints the "
        "results table.",
    )
    parser.add_argument(
        "tasks",
        nargs="*",
        metavar="TASKS",
        help="task files (.py), directories of them, KernelBench selections (kernelbench-v0:1:1-20) or "
        "store URLs of task folders",
    )
    parser.add_argument(
        "-f", "--filename", dest="file", default=None, metavar="FILE", help="manifests ('-': stdin)"
    )
    parser.add_argument(
        "--gpu-class",
        action="append",
        dest="gpu_classes",
        metavar="CLASS",
        help="repeatable; a pool class of the cluster (default: h100)",
    )
    if "verify_on" in OptimizationJobSpec.model_fields:
        parser.add_argument(
            "--verify-on",
            action="append",
            dest="verify_on",
            metavar="CLASS",
            help="repeatable; re-verify and re-time each task's best variant on this class afterwards",
        )
    parser.add_argument(
        "--policy",
        action="append",
        dest="policies",
        metavar="SPEC",
        help="repeatable; compile, replay:FILE.jsonl, openai:MODEL@URL, hf:MODEL, vllm:MODEL "
        "(default: compile)",
    )
    parser.add_argument(
        "--api-key-secret",
        default=None,
        metavar="SECRET",
        help="a Secret (key apiKey) with the openai endpoint's key",
    )
    BUDGET_OPTIONS.add_to(parser)
    evaluation = parser.add_argument_group("evaluation")
    EVALUATION_OPTIONS.add_to(evaluation)
    POLICY_SPEC_OPTIONS.add_to(parser)
    SPEC_OPTIONS.add_to(parser)
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="the job's store, s3://bucket/prefix (default: the operator's); local files are uploaded there "
        "(or to $KERNELFLEET_STORE)",
    )
    parser.add_argument("-n", "--namespace", default=None, help="default: the kubeconfig context's")
    parser.add_argument("--name", default=None, help="the resource's name (default: derived from the spec)")
    parser.add_argument("--wait", action="store_true", help="follow it to the end and print the results")
    parser.set_defaults(handler=_lazy("kernelfleet.operator.client._commands", "submit"))
