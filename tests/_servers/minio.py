"""A real MinIO server on loopback, and per-test buckets in it."""

from __future__ import annotations

import secrets
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from minio import Minio

from tests._servers._process import ServerProcess, binary, free_port


class MinioServer:
    """A MinIO server that can be stopped and started again on the same port and data."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.access_key = "kf-test-" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
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


@dataclass
class MinioBucket:
    """What a test gets from the `minio` fixture: a running server and a fresh, empty bucket."""

    server: MinioServer
    bucket: str

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    @property
    def access_key(self) -> str:
        return self.server.access_key

    @property
    def secret_key(self) -> str:
        return self.server.secret_key

    def client(self) -> Minio:
        return self.server.client()

    def config(self) -> dict[str, str]:
        """The environment that points kernelfleet's store at this server."""
        return {
            "KERNELFLEET_S3_ENDPOINT": self.endpoint,
            "KERNELFLEET_S3_ACCESS_KEY": self.access_key,
            "KERNELFLEET_S3_SECRET_KEY": self.secret_key,
            "KERNELFLEET_S3_SECURE": "false",
        }


def fresh_bucket(server: MinioServer) -> MinioBucket:
    name = "kf-" + secrets.token_hex(6)
    server.client().make_bucket(bucket_name=name)
    return MinioBucket(server=server, bucket=name)
