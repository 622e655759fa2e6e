"""The Job/pod builder: placement, GPUs, the locked-down pod, failure policy, Kueue, names."""

from __future__ import annotations

from kernelfleet.core.jobplan import EXIT_DETERMINISTIC
from kernelfleet.operator._jobs import (
    CREDENTIALS_DIR,
    KUEUE_QUEUE_LABEL,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    MAX_JOB_NAME,
    JobOptions,
    Owner,
    container,
    count_indexes,
    indexed_job,
    job_finished,
    job_name,
    label_value,
    pod_spec,
    store_env,
)
from kernelfleet.operator._pools import default_pools
from kernelfleet.operator._settings import OperatorSettings, settings_from_env

OWNER = Owner(
    kind="OptimizationJob", name="level1", namespace="team-a", uid="0f8e7d6c-aaaa-bbbb-cccc-123456789abc"
)


def _job(settings: OperatorSettings, **options: object) -> dict:
    pools = default_pools()
    worker = container(
        name="worker",
        image=settings.worker_image,
        command=["kernelfleet", "worker"],
        env=store_env(settings, "s3://bucket/runs"),
        gpu_resource=pools["a100"].gpu_resource,
        gpus=2,
        store_secret=bool(settings.store_secret),
    )
    pod = pod_spec([worker], settings=settings, gpu_class=pools["a100"], priority_class_name="batch-low")
    return indexed_job(
        name=job_name("level1", "a100", "s0", uid=OWNER.uid),
        owner=OWNER,
        labels={"kernelfleet.io/gpu-class": "a100"},
        pod=pod,
        completions=10,
        options=JobOptions(**options),  # type: ignore[arg-type]
    )


def test_job_is_indexed_owned_labelled_and_placed_on_its_pool() -> None:
    settings = OperatorSettings(store_secret="s3-credentials", s3_endpoint="minio:9000", s3_secure=False)
    job = _job(settings, parallelism=4, backoff_limit_per_index=3)
    meta, spec = job["metadata"], job["spec"]
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "kernelfleet.io/v1alpha1",
            "kind": "OptimizationJob",
            "name": "level1",
            "uid": OWNER.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    for labels in (meta["labels"], spec["template"]["metadata"]["labels"]):
        assert labels["kernelfleet.io/optimizationjob"] == "level1"
        assert labels["kernelfleet.io/gpu-class"] == "a100"
        assert labels["kernelfleet.io/owner-uid"] == OWNER.uid
    assert spec["completionMode"] == "Indexed"
    assert (spec["completions"], spec["parallelism"], spec["backoffLimitPerIndex"]) == (10, 4, 3)
    assert spec["suspend"] is False
    pod = spec["template"]["spec"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    expression = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][0]["matchExpressions"][0]
    assert expression["key"] == "nvidia.com/gpu.product" and "NVIDIA-A100-SXM4-80GB" in expression["values"]
    (worker,) = pod["containers"]
    assert worker["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert pod["priorityClassName"] == "batch-low"
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["KERNELFLEET_STORE"] == "s3://bucket/runs"
    assert env["KERNELFLEET_S3_ENDPOINT"] == "minio:9000"
    assert env["KERNELFLEET_S3_SECURE"] == "false"
    assert env["KERNELFLEET_S3_CREDENTIALS_DIR"] == CREDENTIALS_DIR
    assert not any("SECRET_KEY" in name or "ACCESS_KEY" in name for name in env)
    secret = next(v for v in pod["volumes"] if v["name"] == "store-credentials")
    assert secret["secret"]["secretName"] == "s3-credentials"


def test_pod_is_locked_down() -> None:
    pod = _job(OperatorSettings())["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    assert pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (worker,) = pod["containers"]
    context = worker["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["privileged"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    # Scratch and shared memory are emptyDirs; HOME and the caches live there.
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["scratch"] and volumes["shm"]["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e["value"] for e in worker["env"]}
    assert env["HOME"].startswith("/scratch") and env["TMPDIR"].startswith("/scratch")
    assert "store-credentials" not in volumes  # no Secret configured, none mounted


def test_failure_policy_fails_an_index_on_the_deterministic_exit_code_and_ignores_disruptions() -> None:
    spec = _job(OperatorSettings())["spec"]
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "FailIndex",
        "onExitCodes": {"containerName": "worker", "operator": "In", "values": [EXIT_DETERMINISTIC]},
    }
    assert rules[1] == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert spec["maxFailedIndexes"] == spec["completions"]


def test_kueue_queue_creates_the_job_suspended_with_the_queue_label() -> None:
    job = _job(
        OperatorSettings(),
        queue_name="gpu-queue",
        ttl_seconds_after_finished=600,
        active_deadline_seconds=7200,
        managed_by="kueue.x-k8s.io/multikueue",
    )
    assert job["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "gpu-queue"
    assert job["spec"]["suspend"] is True
    assert job["spec"]["ttlSecondsAfterFinished"] == 600
    assert job["spec"]["activeDeadlineSeconds"] == 7200
    assert job["spec"]["managedBy"] == "kueue.x-k8s.io/multikueue"
    plain = _job(OperatorSettings(), suspend=True)
    assert plain["spec"]["suspend"] is True and KUEUE_QUEUE_LABEL not in plain["metadata"]["labels"]
    assert "ttlSecondsAfterFinished" not in plain["spec"] and "managedBy" not in plain["spec"]


def test_parallelism_never_exceeds_completions() -> None:
    assert _job(OperatorSettings(), parallelism=64)["spec"]["parallelism"] == 10


def test_job_names_are_deterministic_short_and_distinct() -> None:
    name = job_name("level1", "h100", "s0", uid=OWNER.uid)
    assert name == job_name("level1", "h100", "s0", uid=OWNER.uid)
    assert name.startswith("level1-h100-s0-")
    long_name = job_name("x" * 200, "h100", "s12", uid=OWNER.uid)
    assert len(long_name) <= MAX_JOB_NAME
    assert long_name != job_name("x" * 199 + "y", "h100", "s12", uid=OWNER.uid)
    assert job_name("level1", "h100", "s0", uid="other-uid") != name
    assert len(label_value("n" * 250)) <= 63


def test_job_status_helpers() -> None:
    assert count_indexes("1,3-7,9") == 7
    assert count_indexes("") == 0 and count_indexes(None) == 0
    assert job_finished({"status": {"conditions": [{"type": "Complete", "status": "True"}]}}) == "Complete"
    assert job_finished({"status": {}}) is None


def test_settings_read_the_charts_environment_and_flags_win() -> None:
    settings = settings_from_env(
        {
            "KERNELFLEET_WORKER_IMAGE": "reg/worker:1",
            "KERNELFLEET_STORE": "s3://b/p",
            "KERNELFLEET_STORE_SECRET": "creds",
            "KERNELFLEET_S3_SECURE": "false",
            "KERNELFLEET_IMAGE_PULL_SECRETS": "a, b",
        },
        worker_image="reg/worker:2",
    )
    assert settings.worker_image == "reg/worker:2"
    assert settings.default_store == "s3://b/p"
    assert settings.store_secret == "creds"
    assert settings.s3_secure is False
    assert settings.image_pull_secrets == ("a", "b")


def test_the_job_watch_is_filtered_by_label_on_the_server() -> None:
    import kopf
    from kopf._cogs.structs.references import Resource

    from kernelfleet.operator._app import select_on_the_server

    settings = kopf.OperatorSettings()
    select_on_the_server(settings)
    jobs = Resource("batch", "v1", "jobs", kind="Job", namespaced=True)
    assert list(settings.watching.label_selectors.collect(jobs)) == [f"{LABEL_MANAGED_BY}={MANAGED_BY}"]
    # Every Job the operator creates carries the label the watch selects.
    assert _job(OperatorSettings())["metadata"]["labels"][LABEL_MANAGED_BY] == MANAGED_BY
