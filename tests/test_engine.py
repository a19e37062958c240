"""The offline engine as users call it: sampling controls, stops, n > 1, validation, cleanup."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(make_tiny_model):
    return LLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=128,
               max_model_len=512, show_progress=False)


def prompts(k=4, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(4, 30))] for _ in range(k)]


def assert_all_free(llm):
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0
    llm.engine.block_manager.check_invariants([])


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = prompts(1)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([p], seeded)[0].outputs[0].token_ids
    others = prompts(5, seed=9)
    mixed = llm.generate(others[:2] + [p] + others[2:],
                         [SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True)] * 2 + [seeded]
                         + [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3)
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = llm.generate([p], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12,
                                                  ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone
    assert_all_free(llm)


def test_sampler_draws_from_the_truncated_distribution():
    """Sampling is exact in distribution: over 40,000 draws each token's frequency sits within 4.5 standard errors
    of its probability after temperature, top-k, top-p and min-p, and truncated tokens never come."""
    import torch

    from engine.sampler import Sampler
    from engine.sequence import Sequence

    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -9.0])
    cases = [
        (SamplingParams(temperature=1.0), torch.ones(8, dtype=torch.bool)),
        (SamplingParams(temperature=0.7, top_k=4), torch.arange(8) < 4),
        (SamplingParams(temperature=1.3, top_p=0.8), None),
        (SamplingParams(temperature=1.0, min_p=0.2), None),
    ]
    n = 40_000
    for params, keep in cases:
        probs = torch.softmax(logits.double() / params.temperature, -1)
        if keep is None and params.top_p < 1:  # keep a token while the mass before it is < top_p
            keep = (probs.cumsum(-1) - probs) < params.top_p
        if keep is None:
            keep = probs >= params.min_p * probs.max()
        want = torch.where(keep, probs, 0.0)
        want /= want.sum()
        sampler = Sampler(8, [], seed=0, device=torch.device("cpu"))
        seqs = [Sequence(f"r{i}", 0, [1], params) for i in range(n)]
        got = torch.bincount(torch.tensor(sampler(logits.expand(n, 8).contiguous(), seqs).token_ids), minlength=8)
        freq = got.double() / n
        assert not bool(got[~keep].any()), (params, got)
        stderr = (want * (1 - want) / n).sqrt()
        assert bool(((freq - want).abs() <= 4.5 * stderr + 1e-12).all()), (params, freq, want)


def test_top_k_1_equals_greedy(llm):
    ps = prompts(3)
    greedy = [o.outputs[0].token_ids for o in llm.generate(ps, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))]
    top1 = [o.outputs[0].token_ids for o in llm.generate(ps, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True))]
    assert top1 == greedy


def test_unseeded_sampling_varies(llm):
    p = prompts(1)[0]
    outs = {tuple(llm.generate([p], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids)
            for _ in range(3)}
    assert len(outs) > 1


def test_stop_token_ids_end_output_including_the_stop_token(llm):
    p = prompts(1)[0]
    full = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_tok = full.token_ids[4]
    first = full.token_ids.index(stop_tok)
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                           stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert_all_free(llm)


def test_stop_string_cuts_text_before_it(llm):
    p = prompts(1, seed=5)[0]
    full = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    text = full.text
    assert len(text) > 10
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text
    assert len(out.token_ids) < len(full.token_ids)
    assert_all_free(llm)


def test_eos_stops_unless_ignored(llm, monkeypatch):
    p = prompts(1)[0]
    full = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    eos = full.token_ids[3]
    engine = llm.engine  # make that token an EOS where the engine reads EOS: the scheduler and the sampler
    monkeypatch.setattr(engine.scheduler, "eos_token_ids", engine.scheduler.eos_token_ids | {eos})
    monkeypatch.setattr(engine.runner.sampler, "eos_token_ids", [*engine.runner.sampler.eos_token_ids, eos])
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(eos) + 1] and out.finish_reason == "stop"
    kept = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, min_tokens=12))[0].outputs[0]
    assert len(kept.token_ids) == 12 and eos not in kept.token_ids and kept.finish_reason == "length"
    assert_all_free(llm)


def test_n_samples_share_prompt_blocks(llm):
    p = prompts(1)[0] + list(range(100, 140))  # > 2 full blocks
    engine = llm.engine
    engine.add_request("share", p, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))
    seqs = engine.output_processor.requests["share"].seqs
    outputs = []
    while engine.has_unfinished_requests():
        if all(s.block_tables for s in seqs):
            shared = len(p) // 16 - (1 if len(p) % 16 == 0 else 0)
            assert seqs[0].block_tables[0][:shared] == seqs[1].block_tables[0][:shared] == seqs[2].block_tables[0][:shared]
            assert all(engine.block_manager.ref_counts[b] >= 3 for b in seqs[0].block_tables[0][:shared])
            break
        outputs += engine.step()
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = [o for o in outputs if o.finished][0]
    assert len(final.outputs) == 3 and [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # independent samples
    assert_all_free(llm)


def test_logprobs(llm):
    p = prompts(1)[0]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert entry[tok].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_penalties_change_output_and_stay_valid(llm):
    p = prompts(1)[0]
    rep = llm.generate([p], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                           repetition_penalty=50.0))[0].outputs[0].token_ids
    assert len(set(rep)) == len(rep)  # a huge penalty forbids repeats of prompt or output tokens
    assert not set(rep) & set(p)


def test_results_in_input_order_and_prompt_forms(llm):
    tok = llm.get_tokenizer()
    text = "The quick brown fox"
    outs = llm.generate([text, {"prompt_token_ids": tok.encode(text)}, {"prompt": text}],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert outs[0].prompt == text and outs[0].prompt_token_ids == tok.encode(text)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    single = llm.generate(tok.encode(text), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -5), ("min_p", 2.0), ("n", 0),
    ("max_tokens", 0), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -3.0),
    ("logprobs", 50), ("min_tokens", -1),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_requests_that_can_never_fit_are_refused_at_once(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 600], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=510))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    assert_all_free(llm)


def test_max_tokens_none_runs_to_max_model_len(make_tiny_model):
    llm = LLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=8, max_model_len=40,
              show_progress=False)
    out = llm.generate([[5] * 30], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_max_model_len_larger_than_pool_is_a_clear_error(make_tiny_model):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=make_tiny_model("llama"), device="cpu", num_kv_blocks=2, max_model_len=100, show_progress=False)


def test_missing_files_and_unsupported_architecture(tmp_path, make_tiny_model):
    import json
    import shutil

    with pytest.raises(FileNotFoundError, match="not a local folder"):
        LLM(model=str(tmp_path / "nope"), show_progress=False)
    src = make_tiny_model("llama")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported"):
        LLM(model=str(bad), show_progress=False)
    noweights = tmp_path / "noweights"
    shutil.copytree(src, noweights)
    (noweights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(model=str(noweights), show_progress=False)


def test_failed_step_fails_only_its_requests_and_frees_blocks(llm, monkeypatch):
    engine = llm.engine
    engine.add_request("boom", prompts(1)[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    real = engine.runner.execute

    def broken(batch):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "execute", broken)
    outs = engine.step()
    assert outs and outs[0].request_id == "boom" and "injected fault" in outs[0].error
    monkeypatch.setattr(engine.runner, "execute", real)
    assert_all_free(llm)
    assert llm.generate(prompts(1), SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids


def test_failed_step_spares_requests_outside_it(make_tiny_model, monkeypatch):
    llm = LLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=128,
              max_num_seqs=1, show_progress=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = llm.generate([prompts(2)[1]], params)[0].outputs[0].token_ids
    engine.add_request("in-step", prompts(2)[0], params)
    engine.add_request("waiting", prompts(2)[1], params)  # max_num_seqs=1: not in the first step
    real = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda batch: (_ for _ in ()).throw(RuntimeError("injected")))
    outs = engine.step()
    assert [o.request_id for o in outs] == ["in-step"] and "injected" in outs[0].error
    monkeypatch.setattr(engine.runner, "execute", real)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.error is None
            done[o.request_id] = o
    assert done["waiting"].outputs[0].token_ids == expected  # untouched by its neighbour's failure
    assert_all_free(llm)


def test_warmup_step_is_the_largest_the_scheduler_can_form_and_runs_the_whole_model(llm):
    """CUDA sizes its KV pool from the peak of this step (ModelRunner._activation_bytes); it must cover the
    whole token budget, every sequence sampling, through every layer, and leave the real pool untouched."""
    import torch

    from engine.model_runner import warmup_batch

    batch, num_blocks = warmup_batch(max_num_seqs=5, max_num_batched_tokens=70, block_size=16)
    assert batch.num_tokens == 70 and len(batch.seqs) == 5 and batch.sample_rows() == [0, 1, 2, 3, 4]
    assert num_blocks == sum(len(s.block_tables[0]) for s in batch.seqs) == 5  # 14 tokens each: one block
    runner = llm.engine.runner
    pool_before = runner.kv_cache.clone()
    calls = []
    hook = runner.model.compute_logits
    runner.model.compute_logits = lambda h: calls.append(h.shape) or hook(h)
    try:
        runner.run_warmup(batch, num_blocks)
    finally:
        runner.model.compute_logits = hook
    assert calls == [torch.Size([5, runner.model.spec.hidden_size])]
    assert torch.equal(runner.kv_cache, pool_before) and runner.kv_caches[0][0].data_ptr() == runner.kv_cache.data_ptr()
    batch, _ = warmup_batch(max_num_seqs=256, max_num_batched_tokens=2048, block_size=16)
    assert batch.num_tokens == 2048 and len(batch.seqs) == 256


def test_fake_steps_run_the_real_scheduler_and_free_everything(make_tiny_model):
    """bench/stream_capacity.py's mode: no model forward, a step of known cost, everything else real (lengths,
    stops by length, KV blocks allocated as tokens grow and all returned)."""
    llm = LLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256,
              show_progress=False, fake_step_s=0.0)
    lens = [1, 7, 40]
    outs = llm.generate(prompts(3), [SamplingParams(max_tokens=n) for n in lens])
    assert [len(o.outputs[0].token_ids) for o in outs] == lens
    assert {t for o in outs for t in o.outputs[0].token_ids} == {llm.engine.runner.fake_token}
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_all_free(llm)
    with pytest.raises(ValueError, match="fake_step_s"):
        LLM(model="default", fake_step_s=-1)


def test_model_may_be_a_hugging_face_repo_id_from_the_local_cache(make_tiny_model, tmp_path, monkeypatch):
    """No network here: the repo is laid out as huggingface_hub caches it, and the engine finds it by its id."""
    import shutil

    import huggingface_hub.constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--kvscale-test--tiny-llama"
    shutil.copytree(make_tiny_model("llama"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM(model="kvscale-test/tiny-llama", dtype="float32", device="cpu", num_kv_blocks=16, max_model_len=64,
              show_progress=False)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        LLM(model="kvscale-test/absent", show_progress=False)
