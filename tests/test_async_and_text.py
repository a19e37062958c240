"""Streaming through AsyncLLM (deltas, cancellation = abort), incremental detokenization, stop-string
hold-back, and the default model answering a chat prompt offline."""
from __future__ import annotations

import asyncio

import pytest

from engine import AsyncLLM, LLM, SamplingParams
from engine.sampling_params import RequestOutputKind
from engine.detokenizer import IncrementalDetokenizer, find_stop_string, stream_safe_length


@pytest.fixture(scope="module")
def async_llm(make_tiny_model):
    llm = AsyncLLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=64,
                   max_model_len=512, show_progress=False)
    yield llm
    llm.shutdown()


def test_each_output_kind_adds_up_to_the_offline_result(async_llm, make_tiny_model):
    """DELTA outputs carry only what is new and add up; CUMULATIVE ones carry everything so far; FINAL_ONLY
    yields once. All three end where the offline engine ends."""
    prompt = "Streaming text, one token at a time"

    async def collect(kind, rid):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, output_kind=kind)
        items = []
        async for out in async_llm.generate(prompt, params, rid):
            items.append(out.outputs[0])
        return items

    offline = LLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=64,
                  show_progress=False).generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                                       ignore_eos=True))[0].outputs[0]
    deltas = asyncio.run(collect(RequestOutputKind.DELTA, "s-delta"))
    assert 1 <= len(deltas) <= 12  # one item per step, fewer if the reader fell behind
    assert all(c.token_ids for c in deltas), "a delta with nothing new was sent"
    assert [t for c in deltas for t in c.token_ids] == offline.token_ids
    assert "".join(c.text for c in deltas) == offline.text
    assert sum(len(c.logprobs) for c in deltas) == 12 and deltas[-1].num_output_tokens == 12
    assert [c.finish_reason for c in deltas] == [None] * (len(deltas) - 1) + ["length"]
    cumulative = asyncio.run(collect(RequestOutputKind.CUMULATIVE, "s-cum"))
    assert [len(c.token_ids) for c in cumulative] == sorted({len(c.token_ids) for c in cumulative})
    assert cumulative[-1].token_ids == offline.token_ids and cumulative[-1].text == offline.text
    assert len(cumulative[-1].logprobs) == 12
    (final,) = asyncio.run(collect(RequestOutputKind.FINAL_ONLY, "s-final"))
    assert final.token_ids == offline.token_ids and final.finish_reason == "length"


def test_a_slow_reader_gets_merged_outputs_whose_deltas_still_add_up(async_llm):
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=40, ignore_eos=True, logprobs=1,
                            output_kind=RequestOutputKind.DELTA)

    async def collect():
        texts, tokens, lps, items = ["", ""], [[], []], [[], []], 0
        async for out in async_llm.generate([9] * 12, params, "slow"):
            items += 1
            for c in out.outputs:
                texts[c.index] += c.text
                tokens[c.index] += c.token_ids
                lps[c.index] += c.logprobs
            await asyncio.sleep(0.05)  # busier than the engine: several steps land while we sleep
        return texts, tokens, lps, items

    texts, tokens, lps, items = asyncio.run(collect())
    assert items < 40, "nothing was merged"
    cumulative = asyncio.run(_final(async_llm, [9] * 12, params, "slow-again"))
    for c in cumulative.outputs:  # same seed: the same samples, so the merged deltas must add up to them
        assert tokens[c.index] == c.token_ids and texts[c.index] == c.text and len(c.token_ids) == 40
        assert [next(iter(e)) for e in lps[c.index]] == c.token_ids


async def _final(llm, prompt, params, rid):
    import dataclasses

    async for out in llm.generate(prompt, dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY),
                                  rid):
        pass
    return out


def test_a_reused_request_id_is_refused_and_the_first_stream_goes_on(async_llm):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        first = async_llm.generate([3] * 8, params, "dup")
        out = await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            async for _ in async_llm.generate([4] * 8, params, "dup"):
                pass
        async for out in first:
            pass
        return out

    last = asyncio.run(main())
    assert last.finished and len(last.outputs[0].token_ids) == 20


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
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
