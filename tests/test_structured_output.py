"""Structured output, logit bias and the other sampling extras of the offline engine, on a random-init model:
a grammar must hold whatever the weights say."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.llm_engine import load_generation_defaults

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -5, "maximum": 500},
        "kind": {"enum": ["a", "b", "c"]},
        "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}, "label": {"type": "string",
                                                                                    "maxLength": 6}},
                  "required": ["ok", "label"], "additionalProperties": False},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    },
    "required": ["id", "kind", "inner", "items"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(make_tiny_model):
    return LLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=128,
               max_model_len=512, show_progress=False)


def prompts(k: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(4, 20))] for _ in range(k)]


def assert_nothing_held(llm):
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0
    assert llm.engine.structured_outputs.num_live == 0, "a grammar matcher outlived its sequence"


def test_json_schema_holds_at_temperature_1_and_spares_unconstrained_rows(llm):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = prompts(2, seed=7)
    alone = [o.outputs[0].token_ids for o in llm.generate(plain, free)]
    constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_outputs={"json": SCHEMA})
                   for s in range(12)]
    outs = llm.generate(prompts(12) + plain, constrained + [free, free])
    for o in outs[:12]:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0]
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert len({o.outputs[0].text for o in outs[:12]}) > 6
    assert [o.outputs[0].token_ids for o in outs[12:]] == alone  # untouched by the masks beside them
    assert_nothing_held(llm)


def test_n_samples_each_follow_their_grammar_and_other_kinds(llm):
    out = llm.generate(prompts(1), SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=200,
                                                  structured_outputs={"json": SCHEMA}))[0]
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    cases = [({"regex": "[a-c]{2,4}-[0-9]{3}"}, lambda t: re.fullmatch("[a-c]{2,4}-[0-9]{3}", t)),
             ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
             ({"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'}, lambda t: re.fullmatch(r"\(\d+(\+\d+)*\)", t)),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]
    for spec, check in cases:
        for o in llm.generate(prompts(4, seed=5), SamplingParams(temperature=1.0, seed=11, max_tokens=120,
                                                                  structured_outputs=spec)):
            text = o.outputs[0].text
            if o.outputs[0].finish_reason == "stop":
                assert check(text), (spec, text)
            else:  # json_object has no bound on its length; cut by max_tokens, it is still a valid prefix
                assert spec == {"json_object": True} and text.lstrip().startswith("{"), (spec, text)
    assert_nothing_held(llm)


def test_grammar_survives_preemption(make_tiny_model):
    """A pool too small for every sequence at once preempts some; their grammar state carries on."""
    llm = LLM(model=make_tiny_model("llama"), dtype="float32", device="cpu", num_kv_blocks=12, block_size=16,
              max_model_len=160, show_progress=False)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs={"json": SCHEMA})
              for s in range(6)]
    outs = llm.generate(prompts(6, seed=3), params)
    assert llm.stats().num_preemptions_total > 0
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert_nothing_held(llm)


def test_invalid_constraints_are_refused_before_anything_is_queued(llm):
    bad = [{"json": {"type": "nonsense"}}, {"json": "{not json"}, {"regex": "(unclosed"},
           {"grammar": "root ::= undefined_rule"}]
    for spec in bad:
        with pytest.raises(ValueError, match="constraint|JSON"):
            llm.generate(prompts(1), SamplingParams(max_tokens=5, structured_outputs=spec))
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_outputs={"json_object": True}, ignore_eos=True)
    assert_nothing_held(llm)


def test_abort_frees_the_matcher(llm):
    engine = llm.engine
    engine.add_request("r1", prompts(1)[0], SamplingParams(max_tokens=50, structured_outputs={"json": SCHEMA}))
    engine.step()
    assert engine.structured_outputs.num_live == 1
    engine.abort_request("r1")
    assert_nothing_held(llm)


def test_logit_bias_and_stop_string_kept(llm):
    out = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                  logit_bias={1234: 100}))[0].outputs[0]
    assert out.token_ids == [1234] * 6
    banned = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    out = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                  logit_bias={banned.token_ids[0]: -100}))[0].outputs[0]
    assert out.token_ids[0] != banned.token_ids[0]
    for bad in ({-1: 1.0}, {5: 101}, {5: float("nan")}, {5: "x"}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompts(1), SamplingParams(logit_bias={10**9: 1.0}))
    text = banned.text
    stop = text[2:5]
    cut = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[stop]))
    kept = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[stop],
                                                   include_stop_str_in_output=True))
    if stop:
        assert kept[0].outputs[0].text == cut[0].outputs[0].text + stop


def test_generation_config_defaults(tmp_path):
    assert load_generation_defaults(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_length": 100, "bos_token_id": 1}))
    assert load_generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert load_generation_defaults(str(tmp_path)) == {"temperature": 0.0}


def test_properties_come_out_in_the_schema_order(llm):
    schema = {"type": "object", "properties": {"zeta": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    out = llm.generate(prompts(1), SamplingParams(temperature=1.0, seed=0, max_tokens=40,
                                                  structured_outputs={"json": schema}))[0].outputs[0].text
    assert list(json.loads(out)) == ["zeta", "alpha"], out
