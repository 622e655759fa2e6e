"""Store tenancy against the real MinIO, with a MinIO user and policy per namespace: the operator
reaches the store of a job with the credentials of the job's namespace (its store Secret), not its
own, so a job in namespace A can neither read B's prefix (a task selection pointing there is
refused, naming the field) nor have its plan or outcomes anywhere but A's prefix; a TrainingRun
likewise records its spec with its namespace's keys."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from minio import Minio, MinioAdmin
from minio.credentials import StaticProvider
from minio.error import S3Error

from kernelfleet.core.resources import GROUP, VERSION
from kernelfleet.operator.devcluster._jobset import install_crds
from tests._servers._process import wait_for
from tests.support.operator import (
    OperatorProcess,
    apply_crds,
    condition,
    create,
    optimization_job,
    read,
    training_run,
    wait_condition,
)

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 90.0
TASK = (ROOT / "examples" / "tasks").glob("*.py")


def _policy(bucket: str, namespace: str) -> dict[str, Any]:
    """A tenant's policy: read and write its own prefixes only (its jobs' and its inputs')."""
    prefixes = [f"kf/optimizationjobs/{namespace}/", f"kf/trainingruns/{namespace}/", f"teams/{namespace}/"]
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": ["s3:GetObject", "s3:PutObject"],
                "Resource": [f"arn:aws:s3:::{bucket}/{prefix}*" for prefix in prefixes],
            },
            {
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{bucket}"],
                "Condition": {"StringLike": {"s3:prefix": [f"{prefix}*" for prefix in prefixes]}},
            },
            # The S3 client asks where the bucket is before its first request.
            {"Effect": "Allow", "Action": ["s3:GetBucketLocation"], "Resource": [f"arn:aws:s3:::{bucket}"]},
        ],
    }


def _tenant(admin: MinioAdmin, bucket: str, namespace: str) -> tuple[str, str]:
    access, secret = f"user-{namespace}", secrets.token_hex(16)
    admin.user_add(access, secret)
    admin.policy_add(f"tenant-{namespace}", policy=_policy(bucket, namespace))
    admin.attach_policy([f"tenant-{namespace}"], user=access)
    return access, secret


def _secret(kube: Any, namespace: str, keys: tuple[str, str]) -> None:
    kube.core.create_namespaced_secret(
        namespace,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name="kernelfleet-store"),
            string_data={"accesskey": keys[0], "secretkey": keys[1]},
        ),
    )


def test_a_job_reaches_the_store_with_its_namespaces_credentials_only(
    kube: Any, minio: Any, tmp_path: Path
) -> None:
    other = f"{kube.namespace}-b"
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=other)))
    try:
        admin = MinioAdmin(
            endpoint=minio.endpoint,
            credentials=StaticProvider(minio.access_key, minio.secret_key),
            secure=False,
        )
        mine, theirs = _tenant(admin, minio.bucket, kube.namespace), _tenant(admin, minio.bucket, other)
        _secret(kube, kube.namespace, mine)
        _secret(kube, other, theirs)
        store = minio.client()
        code = next(iter(TASK)).read_bytes()
        for namespace in (kube.namespace, other):
            store.put_object(minio.bucket, f"teams/{namespace}/suite/task.py", _stream(code), len(code))
        apply_crds(kube)
        operator = OperatorProcess(
            kube.kubeconfig,
            kube.namespace,
            tmp_path / "operator",
            env=minio.config(),
            args=[
                "--namespace",
                other,
                "--store",
                f"s3://{minio.bucket}/kf",
                "--store-secret",
                "kernelfleet-store",
            ],
        )
        with operator:
            # Its own inputs: planned, under its own prefix, with its own credentials.
            create(
                kube, optimization_job("own", tasks=[f"s3://{minio.bucket}/teams/{kube.namespace}/suite/"])
            )
            resource = wait_condition(kube, "own", "Accepted", timeout=WAIT_S)
            uid = resource["metadata"]["uid"]
            assert store.stat_object(
                minio.bucket, f"kf/optimizationjobs/{kube.namespace}/own/{uid}/plan.json"
            )
            # Another namespace's inputs: refused, naming the field, though the operator's own
            # credentials could read them.
            create(kube, optimization_job("theirs", tasks=[f"s3://{minio.bucket}/teams/{other}/suite/"]))
            refused = wait_condition(kube, "theirs", "Accepted", status="False", timeout=WAIT_S)
            message = (condition(refused, "Accepted") or {}).get("message", "")
            assert "spec.tasks[0]" in message and "access denied" in message, message
            assert read(kube, "theirs")["status"]["phase"] == "Failed"
            # A TrainingRun too: its spec recorded under its own prefix with its namespace's keys,
            # and a store URL into another namespace's prefix refused by the store, though the
            # operator's own credentials could write there.
            install_crds(kube.api_client)
            run = _training_run(kube, "coder")
            assert wait_for(
                "the run's record",
                lambda: _exists(
                    store, minio.bucket, f"kf/trainingruns/{kube.namespace}/coder/{run}/run.json"
                ),
                timeout=WAIT_S,
            )
            _training_run(kube, "elsewhere", store=f"s3://{minio.bucket}/teams/{other}")
            error = wait_for("ReconcileError", lambda: _run_condition(kube, "elsewhere"), timeout=WAIT_S)
            assert error["status"] == "True" and "denied" in error["message"].lower(), error
        # What a worker pod of namespace A holds (A's keys) cannot read B's prefix.
        as_a = Minio(minio.endpoint, access_key=mine[0], secret_key=mine[1], secure=False)
        with pytest.raises(S3Error) as denied:
            as_a.get_object(minio.bucket, f"teams/{other}/suite/task.py")
        assert denied.value.code == "AccessDenied"
    finally:
        kube.core.delete_namespace(other)


def _stream(data: bytes) -> Any:
    import io

    return io.BytesIO(data)


def _training_run(kube: Any, name: str, **spec: Any) -> str:
    body = training_run(name, stages=[{"name": "sft", "type": "sft"}], rewardGpus=0, **spec)
    made = kube.custom.create_namespaced_custom_object(GROUP, VERSION, kube.namespace, "trainingruns", body)
    return str(made["metadata"]["uid"])


def _run_condition(kube: Any, name: str) -> dict[str, Any] | None:
    found = kube.custom.get_namespaced_custom_object(GROUP, VERSION, kube.namespace, "trainingruns", name)
    conditions = (found.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "ReconcileError"), None)


def _exists(store: Minio, bucket: str, key: str) -> bool:
    try:
        store.stat_object(bucket, key)
    except S3Error:
        return False
    return True
