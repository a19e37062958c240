"""Ray Serve LLM (vLLM inside Ray Serve) as a served peer of bench/serve.py, run with the peers' interpreter
(.venv-peers, made by `bash scripts/peers_venv.sh --ray-serve-llm`), never imported by kvscale.

    .venv-peers/bin/python bench/ray_serve_llm_peer.py MODEL_DIR PORT [DTYPE]   # DTYPE: bfloat16 (default) | float32

As measured on this 2-core machine: the engine's placement group gets one logical CPU bundle, and Ray is
started with 4 logical CPUs so the OpenAI ingress has one beside it (the physical cores are shared all the
same). Serves until killed.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]  # bench/kernels.py


def main() -> None:
    model_dir, port = sys.argv[1], int(sys.argv[2])
    dtype = sys.argv[3] if len(sys.argv) > 3 else "bfloat16"
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    ray.init(num_cpus=4)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = LLMConfig(
        model_loading_config={"model_id": Path(model_dir).name, "model_source": model_dir},
        engine_kwargs={"dtype": dtype, "max_model_len": 2048, "max_num_seqs": 256,
                       "max_num_batched_tokens": 2048},
        placement_group_config={"bundles": [{"CPU": 1}]},
        deployment_config={"num_replicas": 1},
    )
    serve.run(build_openai_app({"llm_configs": [config]}), blocking=False)
    print(f"ray serve llm ready on port {port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
