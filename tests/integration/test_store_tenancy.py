"""Store tenancy against the real MinIO, with a MinIO user and policy per namespace: the operator
reaches the store of a job with the credentials of the job's namespace (its store Secret), not its
own, so a job in namespace A can neither read B's prefix (a task selection pointing there is
refused, naming the field) nor have its plan or outcomes anywhere but A's prefix."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from minio import Minio, MinioAdmin
from minio.credentials import StaticProvider
from minio.error import S3Error

from tests.support.operator import (
    OperatorProcess,
    apply_crds,
    condition,
    create,
    optimization_job,
    read,
    wait_condition,
)

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 90.0
TASK = (ROOT / "examples" / "tasks").glob("*.py")


def _policy(bucket: str, namespace: str) -> dict[str, Any]:
    """A tenant's policy: read and write its own prefixes only (its jobs' and its inputs')."""
    prefixes = [f"kf/optimizationjobs/{namespace}/", f"teams/{namespace}/"]
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
