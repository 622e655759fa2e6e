"""`kernelfleet operator`: run the kopf operator in this process (what the chart's Deployment runs).

    kernelfleet operator --all-namespaces --pools /etc/kernelfleet/pools.yaml \
        --liveness http://0.0.0.0:8080/healthz --metrics-port 9090

Credentials: the pod's service account in a cluster, else KUBECONFIG. Images, the store
endpoint and the store Secret come from the environment the chart sets; see docs/operator.md.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kernelfleet.core.errors import UsageError


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{text} is not a port (1-65535)")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "operator",
        help="run the Kubernetes operator (OptimizationJob, TrainingRun)",
        description="Run the kopf operator that turns OptimizationJobs and TrainingRuns into GPU Jobs. "
        "Uses the in-cluster service account, else KUBECONFIG.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", dest="namespaces", metavar="NS", help="watch NS (repeatable)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--pools",
        metavar="FILE",
        default=None,
        help="GPU pool configuration (the chart's pools.yaml); default: a100, h100, l40, rtx3090 on "
        "nvidia.com/gpu.product ($KERNELFLEET_POOLS_FILE when set)",
    )
    parser.add_argument(
        "--store",
        metavar="URL",
        default=None,
        help="the store for jobs whose spec.store is empty (default: $KERNELFLEET_STORE)",
    )
    parser.add_argument("--worker-image", default=None, help="default: $KERNELFLEET_WORKER_IMAGE")
    parser.add_argument("--trainer-image", default=None, help="default: $KERNELFLEET_TRAINER_IMAGE")
    parser.add_argument(
        "--store-secret",
        default=None,
        metavar="NAME",
        help="Secret (keys accesskey, secretkey) in each job's namespace: the pods mount it and the operator "
        "reaches that job's store with it; default: $KERNELFLEET_STORE_SECRET",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        metavar="URL",
        help="kopf's liveness endpoint; 'none' turns it off",
    )
    parser.add_argument("--metrics-port", type=_port, default=9090, help="Prometheus /metrics port")
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address of the metrics endpoint")
    parser.add_argument("--no-metrics", action="store_true", help="serve no metrics")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument(
        "--standalone", action="store_true", help="no kopf peering (only when one operator can ever run)"
    )
    peering.add_argument(
        "--peering",
        default=None,
        metavar="NAME",
        help="kopf peering object; a second operator in it pauses while this one runs",
    )
    parser.add_argument("--priority", type=int, default=0, help="kopf peering priority")
    parser.add_argument(
        "--status-interval", type=_positive, default=None, metavar="SECONDS", help="status folding period"
    )
    parser.add_argument(
        "--max-indexes-per-job",
        type=int,
        default=None,
        metavar="N",
        help="completion indexes per Indexed Job before a class is sharded into several Jobs",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.set_defaults(handler=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    import os

    from kernelfleet.operator._pools import load_pools
    from kernelfleet.operator._settings import settings_from_env

    if not args.namespaces and not args.all_namespaces:
        raise UsageError("say what to watch: --namespace NS (repeatable) or --all-namespaces")
    if not os.environ.get("KUBERNETES_SERVICE_HOST"):
        from kernelfleet.operator.client._connect import check_kubeconfig, kubeconfig_paths

        check_kubeconfig(*kubeconfig_paths())  # the files kopf's login merges
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:
        # kopf logs every timer pass at INFO ("Timer 'reconcile' succeeded"): one line per job
        # every few seconds. Its warnings and errors stay; the operator logs what it does itself.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    pools = load_pools(args.pools or os.environ.get("KERNELFLEET_POOLS_FILE") or None)
    overrides: dict[str, object] = {
        "pools": pools,
        "default_store": args.store,
        "worker_image": args.worker_image,
        "trainer_image": args.trainer_image,
        "store_secret": args.store_secret,
        "max_indexes_per_job": args.max_indexes_per_job,
    }
    if args.status_interval is not None:
        overrides["status_interval_s"] = args.status_interval
        overrides["min_patch_interval_s"] = args.status_interval
    settings = settings_from_env(None, **overrides)
    # kopf imports the `kubernetes` client library whenever it is installed, only to recognise
    # its objects; the operator never passes any, and the library costs ~20 MB of RSS. Unless
    # something in this process already loaded it, kopf is told it is absent. (Done only here,
    # when the operator really runs: a process that returns from this function keeps its imports.)
    if "kopf" not in sys.modules:
        for name in ("kubernetes", "kubernetes_asyncio", "pykube"):
            sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    from kernelfleet.operator._app import RunOptions, run

    options = RunOptions(
        namespaces=tuple(args.namespaces or ()),
        all_namespaces=args.all_namespaces,
        standalone=args.standalone,
        peering_name=args.peering,
        priority=args.priority,
        liveness=None if args.liveness.lower() == "none" else args.liveness,
        metrics_host=args.metrics_host,
        metrics_port=None if args.no_metrics else args.metrics_port,
    )
    run(settings, options)
    return 0
