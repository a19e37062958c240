"""Streaming through AsyncLLM (deltas, cancellation = abort), incremental detokenization, stop-string
hold-back, and the default model answering a chat prompt offline."""
from __future__ import annotations

import asyncio

import pytest

from engine import AsyncLLM, LLM, SamplingParams
from engine.detokenizer import IncrementalDetokenizer, find_stop_string, stream_safe_length


@pytest.fixture(scope="module")
def async_llm(make_tiny_model):
    llm = AsyncLLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=64,
                   max_model_len=512, show_progress=False)
    yield llm
    llm.shutdown()


def test_stream_deltas_add_up_to_the_offline_result(async_llm, make_tiny_model):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = "Streaming text, one token at a time"

    async def collect():
        text, tokens, n = "", [], 0
        async for out in async_llm.generate(prompt, params, "s1"):
            c = out.outputs[0]
            text += c.text_delta
            tokens += c.token_ids_delta
            n += 1
        return text, tokens, n, out

    text, tokens, n, last = asyncio.run(collect())
    assert 1 <= n <= 12 and last.finished  # one item per step, fewer if the reader fell behind
    assert text == last.outputs[0].text and tokens == last.outputs[0].token_ids
    offline = LLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=64,
                  show_progress=False).generate(prompt, params)[0].outputs[0]
    assert tokens == offline.token_ids and text == offline.text


def test_a_slow_reader_gets_merged_outputs_whose_deltas_still_add_up(async_llm):
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=40, ignore_eos=True, logprobs=1)

    async def collect():
        texts, tokens, items = ["", ""], [[], []], 0
        async for out in async_llm.generate([9] * 12, params, "slow"):
            items += 1
            for c in out.outputs:
                texts[c.index] += c.text_delta
                tokens[c.index] += c.token_ids_delta
            await asyncio.sleep(0.05)  # busier than the engine: several steps land while we sleep
        return texts, tokens, items, out

    texts, tokens, items, last = asyncio.run(collect())
    assert items < 40, "nothing was merged"
    for c in last.outputs:
        assert tokens[c.index] == c.token_ids and texts[c.index] == c.text and len(c.token_ids) == 40
        assert len(c.logprobs) == 40


def test_concurrent_streams_and_cancel_frees_blocks(async_llm):
    async def one(i, params):
        async for out in async_llm.generate([5 + i] * (10 + i), params, f"c{i}"):
            pass
        return out.outputs[0].token_ids

    async def cancelled():
        agen = async_llm.generate([7] * 40, SamplingParams(max_tokens=400, ignore_eos=True), "cancel-me")
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await agen.aclose()

    async def main():
        params = SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True, seed=1)
        results = await asyncio.gather(*(one(i, params) for i in range(6)), cancelled())
        return results[:6]

    results = asyncio.run(main())
    assert all(len(r) == 8 for r in results)
    for _ in range(50):
        stats = async_llm.stats()
        if stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


def test_invalid_request_raises_before_any_output(async_llm):
    async def main():
        async for _ in async_llm.generate([1] * 1000, SamplingParams(max_tokens=4), "too-long"):
            pass

    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(main())


def test_incremental_detokenizer_matches_full_decode(default_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    prompt = tok.encode("Say it:")
    text = " héllo wörld — 世界 🙂 naïve café\n  indented\tdone"
    out_ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt)
    ids, streamed = list(prompt), ""
    for t in out_ids:
        ids.append(t)
        streamed += detok.step(ids)
    assert streamed == tok.decode(out_ids)


def test_stop_string_helpers():
    assert find_stop_string("abc STOP def", 8, ["STOP"]) == ("STOP", 4)
    assert find_stop_string("abc STOP def", 4, ["STOP"]) is None  # completed before the new text
    assert find_stop_string("abcST", 2, ["STOP"]) is None
    assert find_stop_string("xx END yy STOP", 14, ["STOP", "END"]) == ("END", 3)
    assert stream_safe_length("hello ST", ["STOP"], finished=False) == 6  # "ST" may start STOP
    assert stream_safe_length("hello ST", ["STOP"], finished=True) == 8
    assert stream_safe_length("hello", [], finished=False) == 5


@pytest.mark.slow
def test_default_model_names_paris_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM(show_progress=False)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ended on <|im_end|>, not the length cap
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
