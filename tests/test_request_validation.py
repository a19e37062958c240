"""Hypothesis against the engine's request validation: whatever a client sends, the engine either refuses it
with a ValueError before anything is queued, or runs it to the end; and a hostile request never breaks the
step it shares with a well-behaved one (a bad request hurts only itself). Blocks all come back either way.
"""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams

VOCAB = 49152
MAX_MODEL_LEN = 64

junk = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
    st.lists(st.integers(min_value=-3, max_value=VOCAB + 3), max_size=3), st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)

valid = {
    "n": st.integers(min_value=1, max_value=4),
    "temperature": st.floats(min_value=0.0, max_value=2.0),
    "top_p": st.floats(min_value=0.01, max_value=1.0),
    "top_k": st.integers(min_value=-1, max_value=VOCAB + 10),
    "min_p": st.floats(min_value=0.0, max_value=1.0),
    "repetition_penalty": st.floats(min_value=0.01, max_value=1e6),
    "presence_penalty": st.floats(min_value=-2.0, max_value=2.0),
    "frequency_penalty": st.floats(min_value=-2.0, max_value=2.0),
    "max_tokens": st.one_of(st.none(), st.integers(min_value=8, max_value=24)),
    "min_tokens": st.integers(min_value=0, max_value=8),
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=4)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(min_value=0, max_value=VOCAB - 1), max_size=4)),
    "ignore_eos": st.booleans(),
    "seed": st.one_of(st.none(), st.integers(min_value=-2**80, max_value=2**80)),
    "logprobs": st.one_of(st.none(), st.integers(min_value=0, max_value=20)),
    "skip_special_tokens": st.booleans(),
}
near_miss = {  # the edges of each range, some valid, most not
    "n": st.sampled_from([0, -1, 2**70]), "temperature": st.sampled_from([-1e-9, 2.0 + 1e-9, 1e300]),
    "top_p": st.sampled_from([0.0, -0.5, 1.0 + 1e-9]), "top_k": st.sampled_from([-2, 0, 10**30]),
    "min_p": st.sampled_from([-1e-9, 1.5]), "repetition_penalty": st.sampled_from([0.0, -1.0, 1e-300]),
    "presence_penalty": st.sampled_from([-2.5, 2.5]), "frequency_penalty": st.sampled_from([-2.5, 2.5]),
    "max_tokens": st.sampled_from([0, -5, 10**30]), "min_tokens": st.sampled_from([-1, 10**30]),
    "stop": st.sampled_from([[""], ["a", 5], "\ud800"]), "stop_token_ids": st.sampled_from([[-1], [VOCAB], [2**70]]),
    "ignore_eos": st.sampled_from([0, 1, "true"]), "seed": st.sampled_from([2**200, -2**200, 1.0]),
    "logprobs": st.sampled_from([-1, 21, 2**70]), "skip_special_tokens": st.sampled_from([None, "no"]),
}


@st.composite
def sampling_kwargs(draw) -> dict:
    """Well-formed fields, with at most one field (half the time none) off its range or of the wrong type."""
    hostile = draw(st.one_of(st.none(), st.sampled_from(sorted(valid))))
    kwargs = {}
    for name in sorted(valid):
        if name == hostile:
            kwargs[name] = draw(st.one_of(near_miss[name], junk))
        elif draw(st.booleans()):
            kwargs[name] = draw(valid[name])
    return kwargs


prompts = st.one_of(
    st.text(max_size=80), st.text(min_size=1, max_size=40),
    st.sampled_from(["\ud800 lone surrogate", "\x00\x01 control", "emoji \U0001f600 " * 3, "a" * 500]),
    st.lists(st.integers(min_value=-2, max_value=VOCAB + 2), max_size=24),
    st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=MAX_MODEL_LEN - 4, max_size=MAX_MODEL_LEN + 4),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(min_value=0, max_value=VOCAB - 1),
                                                       min_size=1, max_size=8)}),
    junk,
)


@pytest.fixture(scope="module")
def llm(make_tiny_model):
    return LLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=24,
               max_model_len=MAX_MODEL_LEN, max_num_seqs=8, show_progress=False)


def _assert_all_free(llm):
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0
    llm.engine.block_manager.check_invariants([])


@given(kwargs=sampling_kwargs(), prompt=prompts)
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
def test_any_request_is_refused_cleanly_or_runs_beside_a_good_one(llm, kwargs, prompt):
    engine = llm.engine
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        assert str(e)
        event("refused by SamplingParams")
        return
    for value in (params.temperature, params.top_p, params.min_p, params.repetition_penalty):
        assert math.isfinite(value), params  # NaN / inf must not get past validation
    try:
        engine.add_request("bystander", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        try:
            engine.add_request("hostile", prompt, params)
        except ValueError as e:
            assert str(e) and not engine.has_request("hostile")
            event("refused by the engine")
        outputs: dict[str, object] = {}
        for _ in range(10 * MAX_MODEL_LEN):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                assert out.error is None, out.error  # no step may fail: that would fail the bystander too
                outputs[out.request_id] = out
        assert not engine.has_unfinished_requests(), "a request never finished"
        by = outputs["bystander"]
        assert by.finished and len(by.outputs[0].token_ids) == 6
        if "hostile" in outputs:
            out = outputs["hostile"]
            event("ran beside the bystander")
            assert out.finished and len(out.outputs) == params.n
            for c in out.outputs:
                assert 1 <= len(c.token_ids) <= (params.max_tokens or MAX_MODEL_LEN)
                assert all(0 <= t < VOCAB for t in c.token_ids)
                assert c.finish_reason in ("stop", "length")
        _assert_all_free(llm)
    finally:  # whatever failed, leave a clean engine for the next example
        for rid in ("bystander", "hostile"):
            engine.abort_request(rid)


@pytest.mark.parametrize("field,value", [
    ("n", 2**70), ("n", True), ("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")),
    ("min_p", float("nan")), ("repetition_penalty", float("inf")), ("repetition_penalty", float("nan")),
    ("presence_penalty", float("nan")), ("frequency_penalty", float("nan")), ("temperature", "hot"),
    ("max_tokens", 2.5), ("max_tokens", True), ("top_k", 1.5), ("seed", 1.5), ("seed", "42"), ("stop", 5),
    ("stop_token_ids", "12"), ("stop_token_ids", [1.5]), ("logprobs", True), ("ignore_eos", "yes"),
    # 0 or inf once in float32 (0 * inf = nan in the penalized logits; schemathesis found 5e-324 with a grammar)
    ("repetition_penalty", 5e-324), ("repetition_penalty", 1e300),
])
def test_wrong_types_and_non_finite_values_are_value_errors_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.engine.add_request("x", [5, 6], SamplingParams(stop_token_ids=[VOCAB + 7], min_tokens=2))
    assert not llm.engine.has_request("x")
    _assert_all_free(llm)


def test_temperatures_too_small_for_float32_logits_sample_greedily(llm):
    """logits / 5e-324 is inf or nan in float32: such temperatures are greedy (vLLM's 1e-5 threshold), and a
    grammar-constrained request with one still only samples what its grammar allows."""
    params = SamplingParams(temperature=5e-324, max_tokens=8, structured_outputs={"json_object": True})
    assert params.is_greedy and SamplingParams(temperature=1e-5).is_greedy is False
    out = llm.generate([[5, 6, 7, 8]], params)[0]
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_numbers_past_int64_are_floats_or_refused(llm):
    """A JSON integer temperature of 2**63 passed validation and then failed the engine step of every request
    beside it (found by the fuzz test above); 10**400 is beyond a float. Both get a clear answer."""
    params = SamplingParams(temperature=2**63, max_tokens=3, ignore_eos=True)
    assert isinstance(params.temperature, float)
    outs = llm.generate([[5, 6, 7], [8, 9]], [params, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=10**400)
