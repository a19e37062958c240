"""Small helpers the end-to-end tests share (plain functions; pytest puts tests/ on sys.path)."""
from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(urls: list[str], timeout: float, what: str) -> None:
    """Until every url answers 200 (Ray Serve apps take a while to come up on 2 cores), or fail saying so."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if all(httpx.get(url, timeout=5).status_code == 200 for url in urls):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"{what} did not come up within {timeout:.0f} s")


@contextlib.contextmanager
def local_serve(num_cpus: int) -> Iterator[str]:
    """A local Ray cluster with Serve's HTTP proxy on a free port; yields its base URL, shuts both down after."""
    import ray
    from ray import serve

    ray.init(num_cpus=num_cpus, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
