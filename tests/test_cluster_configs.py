"""The deployment files are real configs: cluster.yaml passes the Ray cluster launcher's own schema, and
the Serve config that cluster.yaml deploys (and the KubeRay RayService embeds) passes Ray Serve's schema
and our ServeConfig, and builds into an application without starting Ray."""
from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _ray_cluster_schema() -> dict:
    import ray

    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


def test_cluster_yaml_passes_the_launcher_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(config, _ray_cluster_schema())
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` does: fill defaults, then check
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    gpu_types = [t for t in types.values() if t["resources"].get("GPU", 0) >= 1]
    assert gpu_types and all(t["max_workers"] > t.get("min_workers", 0) for t in gpu_types), \
        "a GPU worker type that the autoscaler can grow"
    assert types[config["head_node_type"]]["resources"].get("GPU", 0) == 0


def test_cluster_yaml_installs_the_project_and_deploys_the_app():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert "." in config["file_mounts"].values()
    setup = "\n".join(config["setup_commands"])
    assert "requirements.txt" in setup and "-e ." in setup and "torch==" in setup
    deploy = [c for c in config["head_start_ray_commands"] if "serve deploy" in c]
    assert deploy, "the head starts the serve app"
    target = re.search(r"serve deploy (\S+)", deploy[0]).group(1)
    assert (ROOT / target).exists()
    assert "ray start --head" in " ".join(config["head_start_ray_commands"])
    assert any("ray start --address" in c for c in config["worker_start_ray_commands"])


def _serve_configs() -> dict[str, dict]:
    manifest = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    return {
        "deploy/serve_gpu.yaml": yaml.safe_load((ROOT / "deploy" / "serve_gpu.yaml").read_text()),
        "deploy/rayservice.yaml serveConfigV2": yaml.safe_load(manifest["spec"]["serveConfigV2"]),
        "serve_app/config.yaml": yaml.safe_load((ROOT / "serve_app" / "config.yaml").read_text()),
    }


def test_rayservice_embeds_the_cluster_serve_config():
    configs = _serve_configs()
    assert configs["deploy/rayservice.yaml serveConfigV2"] == configs["deploy/serve_gpu.yaml"]
    manifest = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    import ray

    assert cluster["rayVersion"] == ray.__version__
    assert cluster["enableInTreeAutoscaling"] is True
    workers = cluster["workerGroupSpecs"]
    assert any(c["resources"]["limits"].get("nvidia.com/gpu") for g in workers
               for c in g["template"]["spec"]["containers"])


@pytest.mark.parametrize("name", ["deploy/serve_gpu.yaml", "deploy/rayservice.yaml serveConfigV2",
                                  "serve_app/config.yaml"])
def test_serve_configs_pass_ray_serve_schema_and_build(name):
    from ray.serve.schema import ServeDeploySchema

    from serve_app.app import build_app, engine_deployment_options
    from serve_app.config import ServeConfig

    raw = _serve_configs()[name]
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(raw)
    (app,) = schema.applications
    assert app.import_path == "serve_app.app:build_app"
    config = ServeConfig(**app.args)  # our own schema: unknown or bad fields are errors
    options = engine_deployment_options(config)
    if config.engine_num_gpus:
        assert config.engine.device.startswith("cuda") and options["ray_actor_options"]["num_gpus"] == 1
    if config.num_replicas is None:
        policy = options["autoscaling_config"]["policy"]
        assert policy["policy_function"] == "serve_app.autoscaling:KVAutoscalingPolicy"
    build_app(app.args)  # builds the Application graph (no Ray needed)


def test_serve_schema_rejects_a_broken_config():
    from ray.serve.schema import ServeDeploySchema

    raw = copy.deepcopy(_serve_configs()["deploy/serve_gpu.yaml"])
    raw["applications"].append(copy.deepcopy(raw["applications"][0]))  # two apps of one name
    with pytest.raises(ValueError):
        ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") \
            else ServeDeploySchema.parse_obj(raw)


def test_serve_build_as_readme_says_writes_a_config_serve_accepts(tmp_path):
    """README: `serve build serve_app:app -o my_config.yaml` writes a fresh config of both deployments."""
    import subprocess
    import sys

    from ray.serve.schema import ServeDeploySchema

    serve_cli = Path(sys.executable).with_name("serve")
    out = tmp_path / "built.yaml"
    subprocess.run([str(serve_cli), "build", "serve_app:app", "-o", str(out)], check=True, capture_output=True,
                   cwd=Path(__file__).resolve().parents[1], timeout=300)
    built = ServeDeploySchema(**yaml.safe_load(out.read_text()))
    (app,) = built.applications
    assert app.import_path == "serve_app:app"
    assert {d.name for d in app.deployments} == {"KVEngine", "OpenAIIngress"}
