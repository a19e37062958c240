"""kvscale as a user installs it: a built wheel (not an editable checkout), used from outside the source tree.

The wheel is installed with --no-deps into a folder put first on PYTHONPATH (its dependencies are those of
this environment), and everything runs from a directory where the checkout is not importable."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    wheels, target = tmp_path_factory.mktemp("wheels"), tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True)
    wheel = next(wheels.glob("kvscale-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True)
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return target, env, tmp_path_factory.mktemp("elsewhere")


def test_wheel_ships_the_c_kernels_and_the_console_script(installed):
    target, env, cwd = installed
    out = subprocess.run([sys.executable, "-c", (
        "import kernels, engine, serve_app.cli\n"
        "from kernels.cpu_native import SOURCE, native\n"
        "print(kernels.__file__); print(SOURCE.exists()); print(native() is not None)\n")],
        cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out[0].startswith(str(target)), f"imported from the checkout, not the wheel: {out[0]}"
    assert out[1] == "True", "kernels/cpu_native.c is not in the wheel"
    assert out[2] == "True", "the C kernels did not build from the installed source"
    script = target / "bin" / "kvscale"
    assert script.exists()
    r = subprocess.run([str(script), "--help"], cwd=cwd, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "kvscale serve" in r.stdout


def test_kvscale_serve_from_the_wheel_serves_the_default_model(installed, tmp_path):
    import openai

    target, env, cwd = installed
    port = free_port()
    config = (target / "serve_app" / "config.yaml").read_text().replace("port: 8000", f"port: {port}")
    config = config.replace("host: 0.0.0.0", "host: 127.0.0.1")
    (tmp_path / "config.yaml").write_text(config)
    proc = subprocess.Popen([str(target / "bin" / "kvscale"), "serve", str(tmp_path / "config.yaml")], cwd=cwd,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert proc.poll() is None, "kvscale serve exited early"
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=12, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content
    finally:
        import signal

        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
