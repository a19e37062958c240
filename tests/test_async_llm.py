"""AsyncLLM's ownership rules: only the engine thread touches engine state; others read the snapshot it
publishes; a failure of the loop itself fails every live request, marks the engine unhealthy and refuses
new requests instead of leaving callers hanging."""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from engine import AsyncLLM, SamplingParams
from engine.sampling_params import RequestOutputKind


def test_stats_read_from_other_threads_while_the_engine_runs_thousands_of_steps(make_tiny_model):
    llm = AsyncLLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=40,
                   max_num_seqs=4, max_model_len=256, show_progress=False)
    errors: list[BaseException] = []
    snapshots = [0]
    done = threading.Event()

    def reader():
        last = llm.stats()
        try:
            while not done.is_set():
                s = llm.stats()
                assert s.num_free_blocks + s.num_used_blocks == s.num_total_blocks == 40
                assert 0 <= s.num_running <= 4 and s.num_waiting >= 0
                assert s.num_steps_total >= last.num_steps_total
                assert s.num_generation_tokens_total >= last.num_generation_tokens_total
                assert s.kv_demand_blocks >= 0 and s.is_healthy
                with pytest.raises(dataclasses.FrozenInstanceError):
                    s.num_free_blocks = 0  # type: ignore[misc]
                last = s
                snapshots[0] += 1
                time.sleep(0.0005)  # a poller, not a spinner: a spinning thread would starve the engine of the GIL
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    async def one(i):
        params = SamplingParams(temperature=0.9, seed=i, max_tokens=120 + i % 7, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        n = 0
        async for out in llm.generate([5 + i % 50] * (8 + i % 30), params, f"r{i}"):
            n += len(out.outputs[0].token_ids) if out.outputs else 0
        return n

    async def main():
        return await asyncio.gather(*(one(i) for i in range(70)))

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        counts = asyncio.run(main())
    finally:
        done.set()
        for t in readers:
            t.join()
        final = llm.stats()
        llm.shutdown()
    assert not errors, errors[0]
    assert counts == [120 + i % 7 for i in range(70)]
    assert final.num_steps_total >= 2000, final.num_steps_total  # thousands of steps, read all along
    assert snapshots[0] > 1000
    assert final.num_free_blocks == final.num_total_blocks and final.num_running == final.num_waiting == 0


def test_a_failing_engine_loop_fails_live_requests_and_marks_the_engine_unhealthy(make_tiny_model):
    llm = AsyncLLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=64,
                   max_model_len=256, show_progress=False)
    engine = llm._engine  # noqa: SLF001 - the fault is injected where only the engine thread looks
    real_schedule = engine.scheduler.schedule
    armed = threading.Event()

    def schedule():
        if armed.is_set():
            raise RuntimeError("injected scheduler bug")
        return real_schedule()

    engine.scheduler.schedule = schedule

    async def stream(rid):
        async for out in llm.generate([7] * 10, SamplingParams(max_tokens=200, ignore_eos=True), rid):
            armed.set()  # both streams have started: break the loop now
        return out

    async def main():
        return await asyncio.gather(stream("a"), stream("b"), return_exceptions=True)

    try:
        results = asyncio.run(main())
        assert all(isinstance(r, RuntimeError) and "injected scheduler bug" in str(r) for r in results), results
        assert not llm.is_healthy and not llm.stats().is_healthy
        with pytest.raises(RuntimeError, match="injected scheduler bug"):
            llm.check_health()

        async def late():
            async for _ in llm.generate([7] * 10, SamplingParams(max_tokens=4), "late"):
                pass

        with pytest.raises(RuntimeError, match="engine loop failed"):
            asyncio.run(asyncio.wait_for(late(), 5))
        s = llm.stats()
        assert s.num_free_blocks == s.num_total_blocks and s.num_running == s.num_waiting == 0
    finally:
        llm.shutdown()


def test_serve_app_uses_only_the_public_surface_of_the_engine():
    """The replica may not reach into the engine or AsyncLLM's private state (that is how engine deques
    came to be iterated from Ray's threads): no `.llm.engine`, no `.llm._anything`, no LLMEngine import."""
    import ast
    from pathlib import Path

    offences = []
    for path in sorted((Path(__file__).resolve().parents[1] / "serve_app").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "llm" and (node.attr == "engine" or node.attr.startswith("_"))):
                offences.append(f"{path.name}:{node.lineno} .llm.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == "engine.llm_engine" and any(
                    a.name == "LLMEngine" for a in node.names):
                offences.append(f"{path.name}:{node.lineno} imports LLMEngine")
    assert not offences, offences


def test_min_interval_merges_steps_into_fewer_outputs_and_never_holds_the_first(make_tiny_model):
    """The serving path's stream_interval_s: outputs at most every interval, each carrying every token produced
    since the last (DELTA: nothing lost, nothing repeated), the first sent as soon as it exists."""
    llm = AsyncLLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=40,
                   max_model_len=256, show_progress=False, fake_step_s=0.005)

    async def run(interval: float):
        params = SamplingParams(max_tokens=60, output_kind=RequestOutputKind.DELTA)
        start, outs = time.monotonic(), []
        async for out in llm.generate([5, 6, 7], params, f"r{interval}", min_interval_s=interval):
            outs.append((time.monotonic() - start, out.outputs[0].token_ids))
        return outs

    try:
        every = asyncio.run(run(0.0))
        merged = asyncio.run(run(0.1))
    finally:
        llm.shutdown()
    assert sum(len(t) for _, t in every) == sum(len(t) for _, t in merged) == 60
    assert len(merged[0][1]) == 1 and merged[0][0] < 0.1  # the first token alone, at once
    assert len(merged) <= 60 * 0.005 / 0.1 + 3 < len(every)  # ~0.3 s of steps in ~0.1 s messages
    gaps = [b - a for (a, _), (b, _) in zip(merged, merged[1:])]
    assert min(gaps) >= 0.1 - 0.01


def test_a_message_budget_spreads_over_the_live_streams(make_tiny_model):
    """max_outputs_per_s bounds the outputs of all streams together (n live streams: each waits n / budget), so a
    serving path that carries only so many messages a second gets fewer, larger ones: every token still arrives
    once, the first of each stream at once."""
    llm = AsyncLLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=80,
                   max_model_len=256, show_progress=False, fake_step_s=0.005)

    async def run(budget: float | None) -> tuple[float, list[list[tuple[float, int]]]]:
        params = SamplingParams(max_tokens=80, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        start = time.monotonic()

        async def one(i: int) -> list[tuple[float, int]]:
            return [(time.monotonic() - start, len(out.outputs[0].token_ids))
                    async for out in llm.generate([5, 6, 7 + i], params, f"b{budget}-{i}", max_outputs_per_s=budget)]

        streams = await asyncio.gather(*(one(i) for i in range(4)))
        return time.monotonic() - start, streams

    try:
        _, free = asyncio.run(run(None))
        wall, budgeted = asyncio.run(run(20.0))
    finally:
        llm.shutdown()
    for outs in free + budgeted:
        assert sum(n for _, n in outs) == 80
    assert all(outs[0][1] == 1 and outs[0][0] < 0.2 for outs in budgeted)  # the first token alone, at once
    sent = sum(len(outs) for outs in budgeted)
    assert sent <= 4 + wall * 20 + 4 < sum(len(outs) for outs in free)  # 4 streams live: each 0.2 s apart
    gaps = [b - a for outs in budgeted for (a, _), (b, _) in zip(outs, outs[1:-1])]
    assert gaps and min(gaps) >= 4 / 20 - 0.02


def test_a_caller_with_its_last_token_sees_its_blocks_back_in_the_stats(make_tiny_model):
    """The snapshot is published before a step's outputs go out: once a request's final output arrives, stats()
    already counts its KV blocks free (the autoscaler, router and tests read stats right after a request)."""
    llm = AsyncLLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=40,
                   max_model_len=256, show_progress=False, fake_step_s=0.0)

    async def run(i: int) -> None:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        async for out in llm.generate(list(range(5, 45)), params, f"r{i}"):
            if out.finished:
                stats = llm.stats()
                assert stats.num_free_blocks == stats.num_total_blocks, (i, stats.num_used_blocks)

    try:
        for i in range(40):
            asyncio.run(run(i))
    finally:
        llm.shutdown()


def test_the_engine_is_built_and_stepped_in_its_own_thread_and_build_errors_reach_the_caller(make_tiny_model,
                                                                                            monkeypatch):
    """One thread runs every torch op of the engine (libgomp keeps a worker pool per thread that opens parallel
    regions; two pools on a 2-core machine made every region end in a sleep, async_llm.py), and a model that
    cannot be built fails AsyncLLM(...) in the caller, as LLM(...) does."""
    from engine.llm_engine import LLMEngine

    threads: dict[str, set[str]] = {"init": set(), "step": set()}
    init, step = LLMEngine.__init__, LLMEngine.step

    def recording_init(self, *args, **kwargs):
        threads["init"].add(threading.current_thread().name)
        init(self, *args, **kwargs)

    def recording_step(self):
        threads["step"].add(threading.current_thread().name)
        return step(self)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    llm = AsyncLLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=40,
                   max_num_seqs=4, max_model_len=256, show_progress=False)
    try:
        assert llm.max_model_len == 256 and llm.stats().num_total_blocks == 40 and llm.is_healthy

        async def one():
            params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
            return [out async for out in llm.generate([5, 6, 7], params, "r0")][-1]

        assert len(asyncio.run(one()).outputs[0].token_ids) == 5
    finally:
        llm.shutdown()
    assert threads == {"init": {"kvscale-engine"}, "step": {"kvscale-engine"}}

    before = threading.active_count()
    with pytest.raises(OSError):
        AsyncLLM(model="/nonexistent/model-folder", dtype="float32", device="cpu", show_progress=False)
    time.sleep(0.1)
    assert threading.active_count() == before  # the engine thread ended with its failed build
