"""ModelRunner.execute(plan) -> RunnerOutput: inputs, forward, logits, sample."""
from __future__ import annotations

import torch
from torch import Tensor

from ember.kernels import CpuKernels
from ember.lora.batch import LoraStep, LoraStepBuilder
from ember.lora.registry import LoraRegistry
from ember.models.attention import PagedKV
from ember.models.llama import LlamaForCausalLM
from ember.request import Request
from ember.runner.inputs import ModelInputs, prepare_inputs
from ember.runner.pooling import Pooler
from ember.sampling.sampler import Sampler
from ember.scheduler.output import RunnerOutput, SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[PagedKV], block_size: int,
                 device: str, seed: int, kernels: CpuKernels | None = None,
                 loras: LoraRegistry | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler(seed, self.device, kernels)
        self.loras = loras
        # the activations' dtype: the norms are never quantized
        self.lora_steps = LoraStepBuilder(model.model.norm.weight.dtype, self.device,
                                          kernels)
        if loras is not None:
            loras.on_evict = self.lora_steps.forget
        self.pooler = Pooler()

    @torch.inference_mode()
    def forward(self, plan: SchedulerOutput, pooled: dict[str, list[float]] | None = None
                ) -> tuple[list[Request], Tensor]:
        """Run the model over the plan's tokens, writing their K/V into the cache.

        Returns the requests that sample this step and their logits [S, vocab] float32;
        `pooled`, if given, gets the vectors of the embedding requests whose prompt ended.
        """
        self._copy_blocks(plan)
        inputs = prepare_inputs(plan, self.block_size, self.device,
                                self.model.stack_runs_decodes(self.kv_caches))
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn,
                            self._lora_step(plan))
        if pooled is not None:
            pooled.update(self.pooler.pool(plan, hidden))
        return self._logits(inputs, hidden)

    def _logits(self, inputs: ModelInputs, hidden: Tensor) -> tuple[list[Request], Tensor]:
        if not inputs.sampling_requests:
            return [], hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        if inputs.logits_indices is not None:
            hidden = hidden[inputs.logits_indices]
        return inputs.sampling_requests, self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward_all(self, plan: SchedulerOutput) -> tuple[ModelInputs, Tensor]:
        """Like forward(), but logits [T, vocab] float32 for every new token of the step (for
        scoring text); rows follow the flat batch of `prepare_inputs`."""
        self._copy_blocks(plan)
        inputs = prepare_inputs(plan, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn,
                            self._lora_step(plan))
        return inputs, self.model.compute_logits(hidden)

    def _lora_step(self, plan: SchedulerOutput) -> LoraStep | None:
        """The step's adapters, row by row (rows follow plan.scheduled), or None."""
        if self.loras is None or all(s.request.lora is None for s in plan.scheduled):
            return None
        return self.lora_steps.build([
            (None if s.request.lora is None else self.loras.acquire(s.request.lora),
             s.num_new_tokens) for s in plan.scheduled])

    def _copy_blocks(self, plan: SchedulerOutput) -> None:
        """Partial prefix-cache hits: copy cached slots into the requests' own blocks."""
        for copy in plan.block_copies:
            for cache in self.kv_caches:
                cache.copy_slots(copy.src, copy.dst, copy.num_tokens)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.sampler.forget(plan.finished_request_ids)
        self.pooler.forget(plan.finished_request_ids)
        if not plan.scheduled:
            return RunnerOutput()
        output = RunnerOutput()
        requests, logits = self.forward(plan, output.pooled)
        if not requests:
            return output
        token_ids, logprobs = self.sampler.sample(logits, requests)
        for request, token_id, logprob in zip(requests, token_ids, logprobs):
            output.sampled_token_ids[request.request_id] = [token_id]
            if logprob is not None:
                output.logprobs[request.request_id] = [logprob]
        return output
