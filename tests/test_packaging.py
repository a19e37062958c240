"""kvscale as a user installs it: `pip install .` (not editable) into a fresh virtualenv, used from outside the
source tree.

The fresh venv sees this environment's site-packages through a .pth file, so kvscale's dependencies (torch,
ray, ...) need not be installed twice; kvscale itself goes into the fresh venv from the checkout, built as a
wheel by pip, and everything runs from a directory where the checkout is not importable."""
from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest
from helpers import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    fresh_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    ours = [p for p in {sysconfig.get_paths()["purelib"], *site.getsitepackages()} if Path(p).is_dir()]
    (fresh_site / "kvscale-test-deps.pth").write_text("\n".join(ours) + "\n")  # the dependencies, not kvscale
    # pip install . (pip itself comes from this environment, acting on the fresh venv's interpreter)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(ROOT)],
                   check=True, cwd=tmp_path_factory.mktemp("build-from-elsewhere"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return venv, fresh_site, env, tmp_path_factory.mktemp("elsewhere")


def test_wheel_ships_the_c_kernels_and_the_console_script(installed):
    venv, fresh_site, env, cwd = installed
    out = subprocess.run([str(venv / "bin" / "python"), "-c", (
        "import kernels, engine, serve_app.cli\n"
        "from kernels.cpu_native import SOURCE, native\n"
        "print(kernels.__file__); print(SOURCE.exists()); print(native() is not None)\n")],
        cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out[0].startswith(str(fresh_site)), f"imported from the checkout, not the installed package: {out[0]}"
    assert out[1] == "True", "kernels/cpu_native.c is not in the wheel"
    assert out[2] == "True", "the C kernels did not build from the installed source"
    script = venv / "bin" / "kvscale"
    assert script.exists()
    r = subprocess.run([str(script), "--help"], cwd=cwd, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "kvscale serve" in r.stdout


def test_kvscale_serve_from_the_wheel_serves_the_default_model(installed, tmp_path):
    import openai

    venv, fresh_site, env, cwd = installed
    port = free_port()
    config = (fresh_site / "serve_app" / "config.yaml").read_text().replace("port: 8000", f"port: {port}")
    config = config.replace("host: 0.0.0.0", "host: 127.0.0.1")
    (tmp_path / "config.yaml").write_text(config)
    env = {k: v for k, v in env.items() if k != "RAY_worker_niceness"}  # its default
    proc = subprocess.Popen([str(venv / "bin" / "kvscale"), "serve", str(tmp_path / "config.yaml")], cwd=cwd,
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
        # the engine replica runs as `kvscale serve` started Ray: at nice 0, not Ray's 15
        (replica,) = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid).startswith(
            "ray::ServeReplica:kvscale:KVEngine")]
        assert os.getpriority(os.PRIO_PROCESS, int(replica)) == 0
        # under SCHED_BATCH, as Ray and everything it started, but for the engine's compute threads
        policies = []
        for tid in os.listdir(f"/proc/{replica}/task"):
            try:
                policies.append((int(tid), os.sched_getscheduler(int(tid))))
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
        assert dict(policies)[int(replica)] == os.SCHED_BATCH, policies
        assert 1 <= sum(p == os.SCHED_OTHER for _, p in policies) <= 4, policies  # engine thread, OpenMP workers
    finally:
        import signal

        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def test_kvscale_serve_leaves_the_cores_to_the_engine(monkeypatch, tmp_path):
    """Ray starts actors at nice 15, where the engine replica yields the cores to every other process, and Serve's
    controller reconciles every 0.1 s; `kvscale serve` starts its Ray with RAY_worker_niceness=0, the controller
    at 0.5 s and the log monitor looking for new files every 2 s, unless the user set them."""
    import os

    from serve_app import cli

    for name in ("RAY_worker_niceness", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD",
                 "LOG_NAME_UPDATE_INTERVAL_S"):
        monkeypatch.setenv(name, "x")  # registered, so the test leaves the environment as it was
        monkeypatch.delenv(name)
    assert cli.serve([str(tmp_path / "missing.yaml")]) == 2  # no config: refused before Ray starts
    assert os.environ["RAY_worker_niceness"] == "0"
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"  # Serve's controller ticks less often
    # Ray's log monitor looks for new log files every 2 s rather than every 0.1 s
    assert (os.environ["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"], os.environ["LOG_NAME_UPDATE_INTERVAL_S"]) == ("0", "2")
    monkeypatch.setenv("RAY_worker_niceness", "5")
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")
    cli.serve([str(tmp_path / "missing.yaml")])
    assert os.environ["RAY_worker_niceness"] == "5"  # the user's choice stands
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"


def test_kvscale_serve_starts_ray_under_sched_batch_unless_told_not_to():
    """What the processes Ray starts inherit: SCHED_BATCH, or Linux's ordinary policy with KVSCALE_SCHED_BATCH=0."""
    code = "import os; from serve_app.cli import _batch_scheduling; _batch_scheduling(); print(os.sched_getscheduler(0))"
    for value, want in ((None, os.SCHED_BATCH), ("1", os.SCHED_BATCH), ("0", os.SCHED_OTHER)):
        env = {k: v for k, v in os.environ.items() if k != "KVSCALE_SCHED_BATCH"}
        if value is not None:
            env["KVSCALE_SCHED_BATCH"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
        assert int(out) == want, (value, out)
