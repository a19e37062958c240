"""Replicas on different nodes of one Ray cluster serve through one endpoint.

`ray.cluster_utils.Cluster` starts a head and two worker nodes (separate raylets) on this machine. The
head holds no CPUs for replicas, so each engine replica must land on a worker node; requests go through
the one HTTP proxy and must be answered by both replicas, with the same greedy tokens from each.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from helpers import free_port, wait_until_serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": True})
    workers = [cluster.add_node(num_cpus=1, resources={"kv_engine": 1}) for _ in range(2)]
    cluster.wait_for_nodes()  # the dashboard on the head serves the state API (which actor on which node)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, workers
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def test_replicas_on_two_nodes_behind_one_endpoint(two_node_cluster, make_tiny_model):
    import ray
    from ray import serve
    from ray.util.state import list_actors

    from serve_app import build_app

    cluster, workers = two_node_cluster
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
    serve.run(build_app({"model": make_tiny_model("llama"), "served_model_name": "tiny", "dtype": "float32",
                         "num_kv_blocks": 64, "max_model_len": 256, "torch_threads": 1, "num_replicas": 2,
                         "engine_num_cpus": 1}), name="multi", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_until_serving([f"{base}/v1/models"], 300, "the app on the two-node cluster")

    engines = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "KVEngine" in (a.name or "")]
    assert len(engines) == 2
    engine_nodes = {a.node_id for a in engines}
    worker_nodes = {w.node_id for w in workers}
    assert engine_nodes == worker_nodes, "one engine replica on each worker node"

    async def ask(c: httpx.AsyncClient, i: int) -> dict:
        body = {"model": "tiny", "prompt": [11, 12, 13, 14, 15, 16], "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        r = await c.post(f"{base}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(ask(c, i) for i in range(24)))

    answers = asyncio.run(main())
    assert len({a["choices"][0]["text"] for a in answers}) == 1, "both replicas give the same greedy text"
    assert all(a["usage"]["completion_tokens"] == 12 for a in answers)

    # Both replicas served: each one's own generation counter, read through the one /metrics endpoint.
    deadline = time.time() + 10
    while time.time() < deadline:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        tokens = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("kvscale:generation_tokens_total{")]
        if len(tokens) == 2 and all(t > 0 for t in tokens) and sum(tokens) == 24 * 12:
            break
        time.sleep(0.5)
    assert len(tokens) == 2 and all(t > 0 for t in tokens), f"per-replica generated tokens: {tokens}"
    assert sum(tokens) == 24 * 12
    assert ray.cluster_resources().get("kv_engine") == 2
    serve.delete("multi")
