"""`kernelfleet store ...`: test a store's connectivity and permissions, list its keys, and
verify that a run's record is consistent (`verify`, or `check --deep RUN`).

`check` is what to run first when a job cannot reach its store: it walks the same path a
worker does (reach the endpoint, find the bucket, list, write, read back) and says at which
step it fails and what to check. It retries only briefly, so a dead endpoint is reported in
seconds rather than after the workers' full retry budget.
"""

from __future__ import annotations

import argparse
import sys

from kernelfleet.core.config import RetrySettings, StoreConfig
from kernelfleet.core.errors import UsageError
from kernelfleet.core.store import LocalStore, Store, open_store, verify_run

_CHECK_RETRY = RetrySettings(attempts=3, initial_backoff_s=0.5, max_backoff_s=2.0, deadline_s=15.0)


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "store",
        help="test and inspect the artifact store",
        description="Test and inspect the artifact store (a directory, file:///... or s3://bucket/prefix).",
    )
    actions = parser.add_subparsers(dest="store_command", metavar="ACTION")

    check = actions.add_parser(
        "check",
        help="test connectivity and permissions",
        description=(
            "Reach the store, list, write a probe object, read it back and delete it; report each "
            "step and what to check when one fails. Exit status 0 when the store is usable, 1 if not."
        ),
    )
    check.add_argument("url", nargs="?", help="store URL (default: $KERNELFLEET_STORE, else .kernelfleet)")
    check.add_argument(
        "--deep",
        metavar="RUN",
        default=None,
        help="also verify a run's consistency (as `store verify`): a run id or a store prefix",
    )
    check.set_defaults(handler=run_check)

    verify = actions.add_parser(
        "verify",
        help="check a run's consistency: results, hashes, conflicts, summaries",
        description=(
            "Walk a run's objects: every result readable and at its own key, its code present and "
            "hashing to its name, no key with two different results, every summary's best variant "
            "backed by a correct result with the speedup it reports. Exit status 0 when consistent, "
            "1 if not."
        ),
    )
    verify.add_argument(
        "args", nargs="+", metavar="[URL] RUN", help="store URL (optional) and run id or prefix"
    )
    verify.set_defaults(handler=run_verify)

    ls = actions.add_parser("ls", help="list keys", description="List the keys under a prefix, sorted.")
    ls.add_argument("url", nargs="?", help="store URL (default: $KERNELFLEET_STORE, else .kernelfleet)")
    ls.add_argument("prefix", nargs="?", default="", help="key prefix, e.g. variants/ (default: everything)")
    ls.set_defaults(handler=run_ls)

    def usage(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    parser.set_defaults(handler=usage)


def run_check(args: argparse.Namespace) -> int:
    config = StoreConfig.from_env()
    config = config.model_copy(update={"retry": _CHECK_RETRY})
    store = open_store(args.url, config)
    print(f"checking {store.url}")
    steps = store.check()
    for step in steps:
        mark = "ok" if step.ok else ("FAIL" if step.required else "warn")
        print(f"  {mark:<5} {step.name:<13} {step.detail}")
    if not all(step.ok or not step.required for step in steps):
        print(f"{store.url} is NOT usable: see the FAIL line above", file=sys.stderr)
        return 1
    print(f"{store.url} is usable")
    if args.deep:
        return _report_run(store, args.deep)
    return 0


def _run_prefix(run: str) -> str:
    """A run id (`kernelfleet optimize` keeps runs under runs/<id>) or a prefix as it is."""
    return run.strip("/") if "/" in run.strip("/") else f"runs/{run.strip('/')}"


def run_verify(args: argparse.Namespace) -> int:
    if len(args.args) > 2:
        raise UsageError("kernelfleet store verify [URL] RUN: at most a store URL and a run")
    url, run = (args.args[0], args.args[1]) if len(args.args) == 2 else (None, args.args[0])
    return _report_run(open_store(url), run)


def _report_run(store: Store, run: str) -> int:
    prefix = _run_prefix(run)
    check = verify_run(store, prefix)
    print(f"verifying {store.url_for(prefix)}: {check.results} result(s), {check.summaries} summar(ies)")
    for finding in check.findings:
        print(f"  {finding.level:<7} {finding.key}: {finding.detail}")
    if check.results == 0 and check.summaries == 0:
        print(f"no run at {store.url_for(prefix)}: check the run id (kernelfleet results lists them)")
        return 1
    if check.ok:
        print(f"{prefix} is consistent")
        return 0
    print(f"{prefix} is NOT consistent: see the error lines above", file=sys.stderr)
    return 1


def run_ls(args: argparse.Namespace) -> int:
    store = open_store(args.url)
    if isinstance(store, LocalStore) and not store.root.exists():
        # Listing a missing directory finds nothing, which reads as "empty": say what it is.
        raise UsageError(f"no store at {store.root}: the directory does not exist; check the path")
    count = 0
    for key in store.list(args.prefix):
        print(key)
        count += 1
    if count == 0:
        where = f"under {args.prefix!r} " if args.prefix else ""
        print(f"no objects {where}in {store.url}", file=sys.stderr)
    return 0
