"""kernelfleet installed into the dev cluster the way a platform engineer installs it: the CRDs
and the chart through `helm install`, with the store Secret in the namespaces jobs run in; then
the operator from the chart's own Deployment, as a local process (there is no kubelet for it).

The operator runs as the chart's ServiceAccount (a token from the TokenRequest API, in a
kubeconfig of its own), so the dev cluster exercises the chart's RBAC exactly: an operator that
needs a permission the chart does not grant fails here as it would on a real cluster.
"""

from __future__ import annotations

import os
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from kernelfleet.core.errors import UsageError
from kernelfleet.core.resources import GROUP
from kernelfleet.operator.devcluster._cluster import BUCKET, ClusterState
from kernelfleet.operator.devcluster._kube import write_token_kubeconfig
from kernelfleet.operator.devcluster._localpod import api_reader, local_command
from kernelfleet.operator.devcluster._process import ServerProcess, binary, wait_for

RELEASE = "kernelfleet"
NAMESPACE = "kernelfleet-system"
JOB_NAMESPACE = "default"
STORE_SECRET = "kernelfleet-store"
# `<release>-<chart>` collapses to the release when it already contains the chart's name.
FULLNAME = "kernelfleet"
CRDS = (f"optimizationjobs.{GROUP}", f"trainingruns.{GROUP}")


def find_chart() -> Path:
    """charts/kernelfleet of this checkout: $KERNELFLEET_CHART, else found from the working
    directory upwards, else next to this package in an editable install."""
    configured = os.environ.get("KERNELFLEET_CHART")
    if configured:
        return Path(configured)
    here = Path(__file__).resolve()
    for base in (Path.cwd(), *Path.cwd().parents, *here.parents):
        candidate = base / "charts" / "kernelfleet"
        if (candidate / "Chart.yaml").is_file():
            return candidate
    raise UsageError(
        "the kernelfleet Helm chart was not found: run this from a kernelfleet checkout, or point "
        "KERNELFLEET_CHART at its charts/kernelfleet folder"
    )


def helm(state: ClusterState, *args: str, timeout: float = 300) -> str:
    home = Path(state.directory) / "helm"
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    result = subprocess.run(
        [str(binary("helm")), *args, "--kubeconfig", state.kubeconfig],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise UsageError(f"helm {args[0]} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def dev_values(state: ClusterState, job_namespaces: tuple[str, ...]) -> dict[str, Any]:
    """The chart values of the dev cluster: its MinIO as the store, the Secret holding its keys."""
    return {
        "store": {
            "url": f"s3://{BUCKET}",
            "endpoint": state.s3_endpoint,
            "secure": False,
            "existingSecret": STORE_SECRET,
            "createBucket": True,
        },
        # The policies render (and are validated by the API server); nothing enforces them here.
        "networkPolicy": {
            "namespaces": list(job_namespaces),
            "store": {
                "to": [{"ipBlock": {"cidr": "127.0.0.1/32"}}],
                "ports": [int(state.s3_endpoint.rsplit(":", 1)[1])],
            },
        },
    }


def install(state: ClusterState, job_namespaces: tuple[str, ...] = (JOB_NAMESPACE,)) -> None:
    """`helm upgrade --install` of the checkout's chart, and the store Secret where it is needed."""
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=state.kubeconfig)
    try:
        core: Any = client.CoreV1Api(api_client)
        for namespace in (NAMESPACE, *job_namespaces):
            _ensure_namespace(core, namespace)
            _ensure_secret(core, namespace, state)
        values = Path(state.directory) / "values.yaml"
        values.write_text(yaml.safe_dump(dev_values(state, job_namespaces)))
        values.chmod(0o600)
        helm(
            state,
            "upgrade",
            "--install",
            RELEASE,
            str(find_chart()),
            "--namespace",
            NAMESPACE,
            "-f",
            str(values),
        )
        extensions: Any = client.ApiextensionsV1Api(api_client)

        def established() -> bool:
            for name in CRDS:
                crd = extensions.read_custom_resource_definition(name)
                if not any(
                    c.type == "Established" and c.status == "True" for c in crd.status.conditions or []
                ):
                    return False
            return True

        wait_for("the kernelfleet CRDs to be established", established, timeout=60.0)
    finally:
        api_client.close()


def _ensure_namespace(core: Any, name: str) -> None:
    from kubernetes.client.exceptions import ApiException

    try:
        core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    except ApiException as error:
        if error.status != 409:
            raise


def _ensure_secret(core: Any, namespace: str, state: ClusterState) -> None:
    from kubernetes.client.exceptions import ApiException

    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": STORE_SECRET, "namespace": namespace},
        "type": "Opaque",
        "stringData": {"accesskey": state.s3_access_key, "secretkey": state.s3_secret_key},
    }
    try:
        core.create_namespaced_secret(namespace, body)
    except ApiException as error:
        if error.status != 409:
            raise
        core.replace_namespaced_secret(STORE_SECRET, namespace, body)


def operator_process(state: ClusterState) -> ServerProcess:
    """The dev cluster's operator: the chart's Deployment in kernelfleet-system, run locally."""
    return chart_operator_process(
        kubeconfig=Path(state.kubeconfig),
        api_server=state.api_server,
        ca_file=Path(state.ca_file),
        namespace=NAMESPACE,
        deployment=f"{FULLNAME}-operator",
        workdir=Path(state.directory) / "operator",
    )


def chart_operator_process(
    *, kubeconfig: Path, api_server: str, ca_file: Path, namespace: str, deployment: str, workdir: Path
) -> ServerProcess:
    """The operator the chart deploys, as a local process running as the chart's ServiceAccount.

    Its command, environment, pools file and store credentials are the Deployment's; only the
    places a pod has of its own (mount paths, its network) are local stand-ins, and its metrics
    listen on 127.0.0.1 (a pod's 0.0.0.0 is its own network; this machine's is not).
    """
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        apps: Any = client.AppsV1Api(api_client)
        core: Any = client.CoreV1Api(api_client)
        template = api_client.sanitize_for_serialization(
            apps.read_namespaced_deployment(deployment, namespace)
        )["spec"]["template"]
        template.setdefault("metadata", {})["namespace"] = namespace
        account = template["spec"].get("serviceAccountName") or "default"
        token = core.create_namespaced_service_account_token(
            account, namespace, {"spec": {"expirationSeconds": 7 * 24 * 3600}}
        ).status.token
        workdir.mkdir(parents=True, exist_ok=True)
        operator_kubeconfig = workdir / "operator.kubeconfig"
        write_token_kubeconfig(operator_kubeconfig, api_server, ca_file, token, account)
        base_env = {key: value for key, value in os.environ.items() if not key.startswith("KERNELFLEET_")}
        base_env.pop("KUBECONFIG", None)
        base_env["KUBECONFIG"] = str(operator_kubeconfig)
        command = local_command(template, api_reader(core), workdir, base_env=base_env)
    finally:
        api_client.close()
    argv = list(command.argv)
    if any(arg.startswith("--metrics-port") for arg in argv):
        argv.append("--metrics-host=127.0.0.1")
    health = command.ports.get(8080)
    return ServerProcess(
        "kernelfleet-operator",
        argv,
        workdir,
        ready=_answers(health) if health else (lambda: True),
        env=command.env,
        inherit_env=False,
        ready_timeout=120.0,
    )


def _answers(port: int) -> Any:
    def check() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return bool(response.status == 200)

    return check
