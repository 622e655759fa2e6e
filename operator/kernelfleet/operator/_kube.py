"""A small asynchronous Kubernetes API client on aiohttp, with kopf's credentials.

kopf watches and patches its own resources; everything else the operator does (create Jobs,
read Secrets and Nodes, post Events) goes through this client. It is deliberately tiny: the
official `kubernetes` package costs tens of megabytes per process and a thread per call, which
the operator's memory target (300 MB with a hundred jobs) cannot afford. It counts its requests
by verb, for the metrics endpoint and the load benchmark.

Credentials come from the same login kopf performs (in-cluster service account, else
KUBECONFIG); a 401 logs in again once, so a rotated service-account token is picked up.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

log = logging.getLogger("kernelfleet.operator.kube")

Login = Callable[[], Awaitable[kopf.ConnectionInfo]]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
USER_AGENT = "kernelfleet-operator"


class ApiError(Exception):
    """A request the API server refused: `status` is the HTTP status, `reason` the Status reason."""

    def __init__(self, method: str, path: str, status: int, reason: str, message: str) -> None:
        super().__init__(f"{method} {path}: {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def transient(self) -> bool:
        """Worth retrying: the server was busy, timed out or failed internally."""
        return self.status in (408, 429) or self.status >= 500


class KubeClient:
    """The operator's API client. One per process, opened in kopf's startup handler."""

    def __init__(self, login: Login, *, timeout_s: float = 60.0, max_connections: int = 16) -> None:
        self._login = login
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._server = ""
        self._lock = asyncio.Lock()
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()

    async def _connect(self) -> aiohttp.ClientSession:
        async with self._lock:
            if self._session is None:
                info = await self._login()
                headers = {**info.as_http_headers(), "User-Agent": USER_AGENT}
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=self._max_connections, ssl=info.as_ssl_context()),
                    headers=headers,
                    timeout=self._timeout,
                )
                self._server = info.server.rstrip("/")
            return self._session

    async def close(self) -> None:
        async with self._lock:
            if self._session is not None:
                await self._session.close()
                self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        for attempt in range(2):
            session = await self._connect()
            self.requests[method] += 1
            data = None if body is None else json.dumps(body)
            headers = {"Content-Type": content_type} if body is not None else {}
            async with session.request(
                method, self._server + path, data=data, params=params, headers=headers
            ) as response:
                text = await response.text()
                if response.status == 401 and attempt == 0:
                    log.info("the API server refused the credentials (401); logging in again")
                    await self.close()
                    continue
                if response.status >= 400:
                    self.errors[str(response.status)] += 1
                    reason, message = str(response.reason or ""), text[:2000]
                    try:
                        status = json.loads(text)
                        reason = status.get("reason", reason)
                        message = status.get("message", message)
                    except ValueError:
                        pass
                    raise ApiError(method, path, response.status, reason, message)
                return json.loads(text) if text else {}
        raise AssertionError("unreachable: the second attempt either returns or raises")

    # ------------------------------------------------------------------ conveniences

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        return await self.request("GET", path, params=params)

    async def get_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.get(path)
        except ApiError as error:
            if error.not_found:
                return None
            raise

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, body=body)

    async def patch(
        self, path: str, body: Mapping[str, Any], content_type: str = MERGE_PATCH
    ) -> dict[str, Any]:
        return await self.request("PATCH", path, body=body, content_type=content_type)

    async def delete(self, path: str, propagation: str = "Background") -> dict[str, Any] | None:
        try:
            return await self.request(
                "DELETE",
                path,
                body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation},
            )
        except ApiError as error:
            if error.not_found:
                return None
            raise

    async def list_all(self, path: str, params: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """Every item of a collection, page by page (500 at a time)."""
        items: list[dict[str, Any]] = []
        query = {**(params or {}), "limit": "500"}
        while True:
            page = await self.get(path, query)
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            query["continue"] = token


def jobs_path(namespace: str, name: str = "") -> str:
    base = f"/apis/batch/v1/namespaces/{quote(namespace)}/jobs"
    return f"{base}/{quote(name)}" if name else base


def custom_path(group: str, version: str, plural: str, namespace: str, name: str = "", sub: str = "") -> str:
    base = f"/apis/{group}/{version}/namespaces/{quote(namespace)}/{plural}"
    if name:
        base += f"/{quote(name)}"
    if sub:
        base += f"/{sub}"
    return base


def core_path(kind_plural: str, namespace: str = "", name: str = "") -> str:
    base = f"/api/v1/namespaces/{quote(namespace)}/{kind_plural}" if namespace else f"/api/v1/{kind_plural}"
    return f"{base}/{quote(name)}" if name else base
