"""LLM: the synchronous Python API. Batches every prompt it is given into one engine run."""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.embed import EmbeddingOutput, PooledSequence
from ember.engine.output import SequenceText
from ember.errors import InvalidRequest
from ember.request import (FinishReason, PoolingParams, RequestOptions, RequestOutput,
                           SamplingParams)
from ember.tokenizer.chat import ChatTemplate, Message

Prompt = str | list[int]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A string, a list of token ids, or a list of either -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    for p in prompts:
        if not (isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p))):
            raise InvalidRequest(f"a prompt must be a string or a list of token ids, not {p!r:.60}",
                                 param="prompt")
    return prompts


class LLM:
    """Offline generation: `LLM().generate(prompts, SamplingParams(...))`.

    `model` is a .gguf file or a Hugging Face folder (None: the default model); other keyword
    options are EngineConfig fields (dtype, device, max_model_len, block_size, kv_cache_gib,
    max_num_seqs, max_num_batched_tokens, seed, ...).
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 **options: Any) -> None:
        self.config = config or EngineConfig.from_options(model=model, **options)
        self.engine = EngineCore(self.config)
        self.engine.advise_kv_huge_pages()   # (no warm-up here: the first call pays)
        self.tokenizer = self.engine.tokenizer
        self._chat_template: ChatTemplate | None = None
        self._ids = itertools.count()
        self._live: dict[str, SequenceText] = {}  # sequences still generating, by request id

    def close(self) -> None:
        """Stop the model's other processes (tensor_parallel_size > 1); the LLM runs no more.
        (They stop too when the LLM is garbage-collected or the interpreter exits.)"""
        self.engine.close()

    @property
    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            self._chat_template = ChatTemplate.of(self.tokenizer)
        return self._chat_template

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 options: RequestOptions | None = None) -> list[RequestOutput]:
        """Run all prompts together (continuous batching); outputs come back in prompt order.

        `options` (priority, cache_salt, prefix_cache, user) apply to every prompt.
        """
        prompt_list = _as_prompt_list(prompts)
        param_list = _as_param_list(params, len(prompt_list))
        outputs, sequences = [], []
        try:
            for prompt, p in zip(prompt_list, param_list):
                output, seqs = self._add(prompt, p, options or RequestOptions())
                outputs.append(output)
                sequences.append(seqs)
            self._run_to_completion([s for seqs in sequences for s in seqs])
        finally:
            for seqs in sequences:  # after an error, nothing of this call stays queued
                for s in seqs:
                    self._drop(s)
        for output, seqs in zip(outputs, sequences):
            output.outputs = [s.output() for s in seqs]
        return outputs

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams | None = None,
              options: RequestOptions | None = None) -> list[EmbeddingOutput]:
        """One L2-normalised vector per prompt, in prompt order, all batched together (and
        with any other work of the engine)."""
        pooling = pooling or PoolingParams()
        seqs: list[PooledSequence] = []
        try:
            for index, prompt in enumerate(_as_prompt_list(prompts)):
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                request = self.engine.add_embedding(f"{next(self._ids)}-0", ids, pooling,
                                                    options or RequestOptions())
                seqs.append(PooledSequence(request, index))
            while any(s.finish_reason is None for s in seqs):
                self._step()
        finally:
            for s in seqs:  # after an error, nothing of this call stays queued
                self.engine.finish(s.request.request_id)
        return [s.take_delta() for s in seqs]

    def chat(self, messages: list[Message] | list[list[Message]],
             params: SamplingParams | None = None, add_generation_prompt: bool = True
             ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each through the chat template."""
        if not messages:
            raise InvalidRequest("messages is empty; send at least one message",
                                 param="messages")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, params)

    def chat_prompt(self, messages: list[Message], add_generation_prompt: bool = True
                    ) -> list[int]:
        """The token ids of `messages` rendered by the model's chat template."""
        text = self.chat_template.render(messages, add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               options: RequestOptions | None = None) -> Iterator[str]:
        """Yield the text of one completion as it is generated."""
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidRequest("stream() makes one completion; use n=1", param="n")
        _, (seq,) = self._add(prompt, params, options or RequestOptions())
        try:
            while not seq.finish_reason:
                self._step()
                delta = seq.stream_delta()
                if delta:
                    yield delta
        finally:
            self._drop(seq)

    def _drop(self, seq: SequenceText) -> None:
        self.engine.finish(seq.request.request_id)
        self._live.pop(seq.request.request_id, None)

    def _add(self, prompt: Prompt, params: SamplingParams,
             options: RequestOptions = RequestOptions()
             ) -> tuple[RequestOutput, list[SequenceText]]:
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = str(next(self._ids))
        seqs = []
        for index, child in enumerate(params.fan_out()):
            request = self.engine.add_request(f"{request_id}-{index}", token_ids, child, options)
            seqs.append(SequenceText(self.tokenizer, request, index))
        text = prompt if isinstance(prompt, str) else None
        self._live.update({s.request.request_id: s for s in seqs})
        return RequestOutput(request_id, text, token_ids, []), seqs

    def _step(self) -> None:
        for request in self.engine.step():
            seq = self._live.get(request.request_id)
            if seq is None:
                continue
            if seq.update():  # a stop string ended it
                self.engine.finish(request.request_id, FinishReason.STOP)
            if seq.finish_reason is not None:
                del self._live[request.request_id]

    def _run_to_completion(self, seqs: list[SequenceText]) -> None:
        while any(s.finish_reason is None for s in seqs):
            self._step()


def _as_param_list(params: SamplingParams | Sequence[SamplingParams] | None,
                   num_prompts: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise InvalidRequest(f"got {len(params)} SamplingParams for {num_prompts} prompts; "
                             "pass one, or one per prompt", param="params")
    return params
