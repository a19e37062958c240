"""LLM: the offline, vLLM-compatible API. `LLM(...).generate(prompts, params)` runs them all to the end."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as SequenceABC
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import EngineStats, LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict


def _as_prompt_list(prompts: Prompt | SequenceABC[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


class LLM:
    def __init__(self, model: str = "default", **kwargs: Any) -> None:
        """kwargs: any field of engine.config.EngineConfig (dtype, device, block_size, num_kv_blocks, ...)."""
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def generate(self, prompts: Prompt | SequenceABC[Prompt],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None) -> list[RequestOutput]:
        """Results come back in input order. A prompt that can never run raises ValueError before any runs."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompt_list) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompt_list):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompt_list)} prompts")
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        request_ids = [f"offline-{next(self._ids)}" for _ in prompt_list]
        try:
            for rid, prompt, p in zip(request_ids, prompt_list, params):
                self.engine.add_request(rid, prompt, p)
            finals: dict[str, RequestOutput] = {}
            while len(finals) < len(request_ids):
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                if not self.engine.has_unfinished_requests() and len(finals) < len(request_ids):
                    raise RuntimeError("engine went idle before every request finished")
        except BaseException:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        for rid in request_ids:
            if finals[rid].error:
                raise RuntimeError(f"request {rid} failed: {finals[rid].error}")
        return [finals[rid] for rid in request_ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """OpenAI-form messages through the tokenizer's chat template; one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": apply_chat_template(self.get_tokenizer(), conv, add_generation_prompt)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params)


def apply_chat_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, **template_kwargs: Any) -> list[int]:
    """Token ids of the rendered chat. tools and template_kwargs (e.g. enable_thinking) go to the template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)
