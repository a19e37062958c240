"""The autoscaling simulator's command line, as a user replays a slice of a trace with it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_replays_a_slice_and_writes_the_rows(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, "bench/autoscale_sim.py", "--trace", "conv", "--start-minute", "10",
                          "--minutes", "1", "--speedup", "2", "--ttft-slo", "1", "5", "--itl-slo", "0.05",
                          "--policies", "ray-default", "--quick", "--jobs", "1", "--max-replicas", "4",
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())
    keys = {"policy", "setting", "replica_seconds", "slo_attainment", "ttft_p99", "itl_p99", "preemptions",
            "completed", "requests"}
    assert all(keys <= row.keys() for row in rows)
    for slo in (1.0, 5.0):
        at = [r for r in rows if r["ttft_slo"] == slo]
        assert {(r["policy"], r["setting"]) for r in at} == {
            ("kvscale", "default"), ("ray-default", "target=16, delay=30"), ("ray-default", "target=64, delay=30")}
        for r in at:
            assert r["requests"] > 100 and r["completed"] == r["requests"]  # every request of the slice ran
            assert 0.0 <= r["slo_attainment"] <= 1.0 and r["replica_seconds"] > 0
    # the same run scored at a looser SLO can only meet it as often or more
    by = {(r["policy"], r["setting"], r["ttft_slo"]): r for r in rows}
    for policy, setting, _ in list(by):
        if policy == "ray-default":  # one run, scored at both SLOs
            assert by[(policy, setting, 5.0)]["slo_attainment"] >= by[(policy, setting, 1.0)]["slo_attainment"]
    assert "kvscale default:" in run.stdout and "ray-default:" in run.stdout
