r"""The Python API: :class:`LLM` and :class:`SamplingParams`, text in, text and token ids out.

:class:`SamplingParams` is the one parameter type of the whole package (defined in
:mod:`bole.sampling_params`, imported here so that ``from bole import SamplingParams`` works):
the engine, the server and the CLI take the same class.

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
from bole.engine import Engine, GenerationResult, SpecConfig, TokenLogprob, default_drafter
from bole.engine.spec import DEFAULT_TREE
from bole.engine.prefix_admission import PrefixCacheConfig
from bole.sampling_params import SamplingParams
from bole.speculative.drafters.registry import FALLBACK_DRAFTER, drafter_info

__all__ = ["LLM", "RequestOutput", "SamplingParams", "TokenLogprob"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


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
        for i, (prompt, p) in enumerate(zip(ids, per_prompt)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"expected bole.SamplingParams, got {type(p).__name__}")
            self.engine.check_request(prompt, p, f"prompt {i}")

        scheduler = Scheduler(self.engine, max_queue=len(texts))
        handles = [scheduler.submit(prompt, p, checked=True)
                   for prompt, p in zip(ids, per_prompt)]
        scheduler.run_until_idle()
        return [self._output(text, prompt, h.result, p)
                for text, prompt, h, p in zip(texts, ids, handles, per_prompt)]

    def _output(self, text: str, prompt: list[int], result: GenerationResult,
                params: SamplingParams) -> RequestOutput:
        return RequestOutput(prompt=text, prompt_token_ids=list(prompt),
                             text=self.engine.text(result, params),
                             token_ids=list(result.token_ids), finish_reason=result.finish_reason,
                             rounds=result.rounds,
                             mean_accepted_tokens=result.mean_accepted_tokens,
                             logprobs=result.logprobs)
