r"""The Python API: :class:`LLM` and :class:`SamplingParams`, text in, text and token ids out.

In the spirit of vLLM's and nano-vllm's offline API. The example below is the README's; it runs
verbatim in ``tests/test_api_example.py``:

```python
from bole import LLM, SamplingParams

llm = LLM()  # the bundled model; its MTP head drafts the trees
params = SamplingParams(temperature=0, max_tokens=32, stop=["\ndef "])
outputs = llm.generate(["def fib(n):", "class Stack:"], params)
for out in outputs:
    print(out.prompt + out.text)
    print(f"[{len(out.token_ids)} tokens, {out.mean_accepted_tokens:.2f} per round, "
          f"finish: {out.finish_reason}]")
```

``LLM`` loads a checkpoint folder (default: the bundled model) with the CLI's defaults: the
checkpoint's MTP head drafts when it has one (n-gram lookup otherwise), bf16 on a GPU and fp32 on
the CPU. ``generate`` runs every prompt through the engine's continuous-batching scheduler
(at most ``max_batch`` at once) and returns one :class:`RequestOutput` per prompt, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from bole.assets import BUNDLED_MODEL
from bole.engine import (Engine, GenerationParams, GenerationResult, SpecConfig, TokenLogprob,
                         default_drafter)
from bole.engine.spec import DEFAULT_TREE
from bole.engine.prefix_admission import PrefixCacheConfig
from bole.speculative import sampling
from bole.speculative.drafters.registry import FALLBACK_DRAFTER, drafter_info

__all__ = ["LLM", "RequestOutput", "SamplingParams", "TokenLogprob"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature: 0 is greedy (the default); top_p: nucleus mass (1 = off); top_k: sample among the
    k most likely tokens (0 = off); max_tokens: output tokens at most; stop: strings that end the
    output (not returned with it), besides the checkpoint's end-of-sequence tokens; seed: seeds
    this request's draws (random when None), so a seeded request samples the same tokens
    whatever else runs in its batch.

    presence_penalty, frequency_penalty: OpenAI's, in [-2, 2], over the generated tokens;
    repetition_penalty: vLLM's / Hugging Face's (> 0, 1 = off), over the prompt's and the
    generated tokens; all exact under speculation (see
    :func:`bole.speculative.sampling.apply_penalties`). stop_token_ids: tokens that end the
    output (returned with it), besides the end-of-sequence tokens unless ignore_eos. logprobs:
    None, or each output token's log-probability with this many (0 to 20) most likely
    alternatives, under the model's raw distribution (before penalties and temperature).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    stop: str | Sequence[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def target(self) -> sampling.SamplingParams:
        """The target distribution's parameters (temperature, top-k, top-p) as the engine takes
        them; raises ValueError naming a bad value."""
        target = sampling.SamplingParams(temperature=self.temperature, top_k=self.top_k,
                                         top_p=self.top_p, presence_penalty=self.presence_penalty,
                                         frequency_penalty=self.frequency_penalty,
                                         repetition_penalty=self.repetition_penalty)
        target.validate()
        return target


@dataclass
class RequestOutput:
    """One prompt's result.

    prompt: the prompt text; prompt_token_ids: its tokens; text: the generated text (cut before a
    stop string); token_ids: the generated tokens; finish_reason: "length" (max_tokens reached)
    or "stop" (a stop string or end-of-sequence token); rounds: speculative rounds it took;
    mean_accepted_tokens: tokens emitted per round (1 for plain decoding); logprobs: one
    :class:`TokenLogprob` per token of token_ids when asked for (else None).
    """

    prompt: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    rounds: int
    mean_accepted_tokens: float
    logprobs: list[TokenLogprob] | None = None


def _device(name: str | torch.device | None) -> torch.device:
    """``name`` as a device Bole runs on (cpu or cuda), default cuda when available."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}; use 'cpu' or 'cuda'") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported; use 'cpu' or 'cuda'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for a GPU, but this PyTorch sees none; "
                         "use device='cpu'")
    return device


def _dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """bf16 on a GPU and fp32 on the CPU unless ``dtype`` says otherwise."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    resolved = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype {dtype!r} is not supported; use bf16, fp16 or fp32")
    return resolved


def _checkpoint_folder(model: str | Path) -> Path:
    """The checkpoint folder, checked for the files the API needs before anything loads."""
    folder = Path(model)
    if not folder.is_dir():
        raise ValueError(f"the model folder {folder} does not exist (or is not a folder); give a "
                         "checkpoint folder, or leave model out for the bundled model")
    missing = [f for f in ("config.json", "tokenizer.json") if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"{folder} is not a checkpoint folder: {', '.join(missing)} missing")
    return folder


class LLM:
    """A model with its tokenizer and a speculative engine over it.

    Args:
        model: checkpoint folder (config.json, safetensors, tokenizer.json); default the bundled
            model (``bole/bundled/``).
        mode: ``bole``, ``tree-serial``, ``chain`` or ``ar`` (no speculation).
        drafter: ``mtp``, ``ngram`` or ``draft`` (with ``draft_model``); default the checkpoint's
            MTP head when it has one, else n-gram lookup.
        draft_model: checkpoint folder of a separate draft model (same tokenizer).
        device: ``cpu`` or ``cuda``; default cuda when available.
        dtype: weights and activations, ``bf16``, ``fp16`` or ``fp32`` (or a torch dtype);
            default bf16 on a GPU, fp32 on the CPU.
        max_batch: requests decoded together; more wait for a free slot.
        max_len: cache positions per request (prompt + output + one round's tree), at most the
            model's context.
        depth, topk, budget: the draft tree: depth, children per expanded node, nodes per
            request (root included).
        prefix_cache: keep the state of committed prompt prefixes, so that a prompt starting
            like an earlier one skips that part of its prefill (output unchanged).
        prefix_cache_gib: memory the prefix cache may hold (default: a tenth of the GPU's, at
            most 16 GiB; 1 GiB on the CPU).
    """

    def __init__(self, model: str | Path | None = None, *, mode: str = "bole",
                 drafter: str | None = None, draft_model: str | Path | None = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 max_batch: int = 8, max_len: int = 4096, depth: int = DEFAULT_TREE[0],
                 topk: int = DEFAULT_TREE[1], budget: int = DEFAULT_TREE[2],
                 prefix_cache: bool = True, prefix_cache_gib: float | None = None):
        from tokenizers import Tokenizer

        from bole.models.config import HybridConfig
        from bole.models.qwen3_hybrid import HybridModel

        folder = _checkpoint_folder(BUNDLED_MODEL if model is None else model)
        dev = _device(device)
        dt = _dtype(dtype, dev)
        # everything that can be checked without the weights is checked first
        SpecConfig(mode, drafter or FALLBACK_DRAFTER, depth, topk, budget).validate()
        if (drafter is not None and drafter_info(drafter).needs_draft_model
                and draft_model is None and mode != "ar"):
            raise ValueError(f"drafter={drafter!r} needs draft_model, a draft checkpoint's folder")
        if max_batch < 1 or max_len < 2:
            raise ValueError(f"need max_batch >= 1 and max_len >= 2, got {max_batch}, {max_len}")
        context = HybridConfig.from_pretrained(folder).max_position_embeddings
        if max_len > context:
            raise ValueError(f"max_len={max_len} exceeds the model's context of {context} "
                             "positions; pass max_len <= that")
        try:
            self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:                # tokenizers raises a bare Exception
            raise ValueError(f"{folder / 'tokenizer.json'} is not a readable tokenizer "
                             f"({exc})") from None

        self.model = HybridModel.from_pretrained(folder, dtype=dt, device=dev)
        drafts = (HybridModel.from_pretrained(_checkpoint_folder(draft_model), dtype=dt,
                                              device=dev) if draft_model is not None else None)
        if drafter is None:
            drafter = default_drafter(self.model, drafts)
        self.spec = SpecConfig(mode, drafter, depth, topk, budget)
        self.engine = Engine(self.model, self.spec, max_slots=max_batch, max_len=max_len,
                             tokenizer=self.tokenizer, draft_model=drafts,
                             prefix_cache=PrefixCacheConfig(prefix_cache_gib)
                             if prefix_cache else None)

    def generate(self, prompts: str | Sequence[str],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for one prompt or a list of prompts; ``sampling_params`` is one set for all
        or one per prompt (default: greedy, 64 tokens). Returns one output per prompt, in order.
        Every request is checked (a ValueError names the first bad one) before any runs."""
        from bole.engine.scheduler import Scheduler

        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not texts or any(not isinstance(t, str) for t in texts):
            raise ValueError("prompts must be a string or a non-empty list of strings")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            per_prompt = [sampling_params or SamplingParams()] * len(texts)
        else:
            per_prompt = list(sampling_params)
            if len(per_prompt) != len(texts):
                raise ValueError(f"{len(per_prompt)} SamplingParams for {len(texts)} prompts")
        ids = [self.tokenizer.encode(t).ids for t in texts]
        params = [self._generation_params(p) for p in per_prompt]
        for i, (prompt, p) in enumerate(zip(ids, params)):
            self.engine.check_request(prompt, p, f"prompt {i}")

        scheduler = Scheduler(self.engine, max_queue=len(texts))
        handles = [scheduler.submit(prompt, p, seed=sp.seed)
                   for prompt, p, sp in zip(ids, params, per_prompt)]
        scheduler.run_until_idle()
        return [self._output(text, prompt, h.result, p)
                for text, prompt, h, p in zip(texts, ids, handles, params)]

    def _generation_params(self, sp: SamplingParams) -> GenerationParams:
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"expected bole.SamplingParams, got {type(sp).__name__}")
        if sp.seed is not None and not isinstance(sp.seed, int):
            raise ValueError(f"seed must be an integer or None, got {sp.seed!r}")
        eos = () if sp.ignore_eos else tuple(self.model.config.eos_token_id)
        return GenerationParams(max_tokens=sp.max_tokens, sampling=sp.target(),
                                stop_token_ids=eos + tuple(sp.stop_token_ids),
                                stop_strings=sp.stop_strings, logprobs=sp.logprobs)

    def _output(self, text: str, prompt: list[int], result: GenerationResult,
                params: GenerationParams) -> RequestOutput:
        return RequestOutput(prompt=text, prompt_token_ids=list(prompt),
                             text=self.engine.text(result, params),
                             token_ids=list(result.token_ids), finish_reason=result.finish_reason,
                             rounds=result.rounds,
                             mean_accepted_tokens=result.mean_accepted_tokens,
                             logprobs=result.logprobs)
