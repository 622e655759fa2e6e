"""A real MinIO server on loopback (from `kernelfleet.operator.devcluster`), and per-test buckets in it."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from minio import Minio

from kernelfleet.operator.devcluster._minio import MinioServer

__all__ = ["MinioBucket", "MinioServer", "fresh_bucket"]


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
