"""`LLM`: the offline API modelled on vLLM's (`LLM(model=None, **engine_args).generate(...)`),
driving an LLMEngine in this process.
"""
from __future__ import annotations

import concurrent.futures
from typing import Any, Iterable

import msgspec

from atomd.config import EngineConfig
from atomd.engine.llm_engine import LLMEngine, ranked_choices
from atomd.engine.lora_registry import LoraNotLoaded
from atomd.messages import RequestOutput
from atomd.tokenizer import Tokenizer
from contracts.sampling import SamplingParams
from scheduler.sequence import Sequence
from scheduler.stop import cut_at_stop
from contracts.logprobs import Logprob

TQDM_MIN_PROMPTS = 16  # a progress bar only where the wait is long enough to want one


class CompletionOutput(msgspec.Struct):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[Logprob | None] | None = None  # per token (contracts/logprobs.py)
    cumulative_logprob: float | None = None  # of the sampled tokens (raw model logprobs)


class GenerationOutput(msgspec.Struct):
    """One prompt's result from `LLM.generate` (vLLM's offline RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[Logprob | None] | None = None  # per prompt token (None for the first), when asked


class LLM:
    """Offline generation: `LLM(model=None, **engine_args).generate(prompts, sampling_params)`."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        self._start(EngineConfig.from_kwargs(model=model, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        if config.model_runner == "simulated":  # atomd/sim/engine.py: the same loop, a predicted forward
            from atomd.sim.engine import SimulatedEngine

            self.engine = SimulatedEngine(config)
        else:
            self.engine = LLMEngine(config)
        self._counter = 0

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Load LoRA adapter `name` now and wait for it: {"name"} or {"error", "status"} (the
        engine reads it on its background thread, atomd/engine/lora_registry.py)."""
        answer = self.engine.load_lora_adapter(name, path)
        if not isinstance(answer, concurrent.futures.Future):
            return answer
        while not answer.done():
            self.engine.loras.wait_for_loads()
            self.engine.finish_lora_loads()
        return answer.result()

    def generate(self, prompts: str | dict | Iterable[str | dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_name: str | list[str | None] | None = None) -> list[GenerationOutput]:
        """`lora_name`: the LoRA adapter (of `lora_modules`) of every prompt, or one per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        loras = lora_name if isinstance(lora_name, list) else [lora_name] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_name: {len(loras)} given for {len(prompts)} prompts")
        requests: dict[str, tuple[str | None, Sequence]] = {}
        try:
            for prompt, sp, lora in zip(prompts, params, loras):
                text, ids = self._prompt_ids(prompt)
                request_id = f"offline-{self._counter}"
                self._counter += 1
                requests[request_id] = (text, self.engine.add_request(request_id, ids, sp, lora_name=lora))
        except (ValueError, LoraNotLoaded):  # a bad prompt or adapter: the batch is refused whole, the engine left clean
            for request_id in requests:
                self.engine.abort_request(request_id)
            raise
        return self._run(requests, use_tqdm and len(prompts) >= TQDM_MIN_PROMPTS)

    def _prompt_ids(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.engine.tokenizer.encode(prompt["prompt"])
        raise ValueError("prompts: each prompt must be a string or a dict with prompt_token_ids")

    def _run(self, requests: dict[str, tuple[str | None, Sequence]], progress: bool) -> list[GenerationOutput]:
        done: dict[str, GenerationOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(done) < len(requests):
                if not self.engine.scheduler.running and self.engine.lora_loads_pending():
                    self.engine.loras.wait_for_loads()  # nothing runs until an adapter is read: no spinning
                for out in self.engine.step():
                    if out.request_id not in requests:
                        continue
                    if out.finished:
                        prompt, seq = requests[out.request_id]
                        done[out.request_id] = self._final(out, prompt, seq)
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in requests]

    def _final(self, out: RequestOutput, prompt: str | None, seq: Sequence) -> GenerationOutput:
        """The request's choices (n of them; the best n of best_of), from its sequences."""
        completions = []
        for index, choice in enumerate(ranked_choices(seq)):
            token_ids = choice.completion_token_ids
            text = self.engine.tokenizer.decode(token_ids)
            stop = choice.stop_reason
            if isinstance(stop, str):  # the text ends at the stop string
                text, _ = cut_at_stop(text, [stop], choice.sampling_params.include_stop_str_in_output)
            finish = choice.finish_reason if choice.finish_reason is not None else out.finish_reason
            completions.append(CompletionOutput(index, text, token_ids, finish, stop, list(choice.logprobs) or None,
                                                choice.cumulative_logprob))
        return GenerationOutput(out.request_id, prompt, seq.prompt_token_ids, completions, True,
                                out.num_cached_tokens, out.error, seq.prompt_logprobs)
