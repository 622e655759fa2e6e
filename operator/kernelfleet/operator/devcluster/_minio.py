"""A real MinIO server on loopback: the S3 store of the dev cluster and of the tests."""

from __future__ import annotations

import secrets
import urllib.request
from pathlib import Path

from minio import Minio

from kernelfleet.operator.devcluster._process import ServerProcess, binary, free_port


class MinioServer:
    """A MinIO server that can be stopped and started again on the same port and data.

    Its root credentials are made up at random for each server: nothing outside the machine
    reaches it (it listens on 127.0.0.1 only), and nothing guessable protects it either.
    """

    def __init__(
        self,
        workdir: Path,
        access_key: str | None = None,
        secret_key: str | None = None,
        public_metrics: bool = False,
    ) -> None:
        """`public_metrics` serves Prometheus metrics (request counts by S3 API) without a token,
        for a benchmark that counts a process's store requests."""
        self.port = free_port()
        self.access_key = access_key or "kf-" + secrets.token_hex(4)
        self.secret_key = secret_key or secrets.token_hex(16)
        console = free_port()
        self.process = ServerProcess(
            "minio",
            [
                str(binary("minio")),
                "server",
                "--quiet",
                "--address",
                f"127.0.0.1:{self.port}",
                "--console-address",
                f"127.0.0.1:{console}",
                str(workdir / "data"),
            ],
            workdir,
            ready=self._live,
            env={
                "MINIO_ROOT_USER": self.access_key,
                "MINIO_ROOT_PASSWORD": self.secret_key,
                "MINIO_BROWSER": "off",
                "MINIO_UPDATE": "off",
                **({"MINIO_PROMETHEUS_AUTH_TYPE": "public"} if public_metrics else {}),
            },
        )

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _live(self) -> bool:
        with urllib.request.urlopen(f"http://{self.endpoint}/minio/health/ready", timeout=2) as response:
            return bool(response.status == 200)

    def start(self) -> None:
        self.process.start()

    def stop(self) -> None:
        self.process.stop()

    def client(self) -> Minio:
        return Minio(
            endpoint=self.endpoint, access_key=self.access_key, secret_key=self.secret_key, secure=False
        )
