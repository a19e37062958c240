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


# The local cluster that the end-to-end modules named in conftest.SHARES_CLUSTER use one after another (conftest.py
# runs them last, back to back): starting Ray and Serve and shutting them down costs 10-15 s a module on 2 cores.
_shared: dict = {}


@contextlib.contextmanager
def local_serve(num_cpus: int, share: bool = False) -> Iterator[str]:
    """A local Ray cluster with Serve's HTTP proxy on a free port; yields its base URL.

    share=False: started here and shut down after. share=True: the cluster the previous sharing module left, if
    it has as many CPUs, else a new one; on the way out every application is deleted (so the next module finds
    Serve as a fresh one) and the cluster stays up until stop_shared()."""
    import ray
    from ray import serve

    if _shared and (not share or _shared["num_cpus"] != num_cpus):
        stop_shared()
    if not _shared:
        ray.init(num_cpus=num_cpus, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _shared.update(num_cpus=num_cpus, base=f"http://127.0.0.1:{port}")
    base = _shared["base"]
    try:
        yield base
    finally:
        if share:
            for name in list(serve.status().applications):
                serve.delete(name)  # waits until its replicas are gone
        else:
            stop_shared()


def stop_shared() -> None:
    """Shut down the cluster local_serve left running, if any (conftest.py calls it at the end of the session,
    and local_serve before starting another)."""
    import ray
    from ray import serve

    if _shared:
        _shared.clear()
        serve.shutdown()
        ray.shutdown()
