"""The serving engine: engine.py (admission and a step: plan, round, emit), spec.py (the
speculative configuration), request.py (requests, their parameters -- the one SamplingParams --
and results), scheduler.py (continuous batching), round.py (one round: plan, phases, result) with
phases.py, admission.py, buffers.py, timings.py, buckets.py and graphs.py (CUDA graphs), runner.py
(the model runner's forwards and commits), calibrate.py (measuring a budget profile), lockstep.py
(tensor-parallel serving), prefix_cache.py and prefix_admission.py (the prefix cache)."""

from bole.engine.engine import Engine
from bole.engine.request import GenerationResult, SamplingParams, TokenLogprob
from bole.engine.spec import DRAFTERS, MODES, SpecConfig, default_drafter

__all__ = ["DRAFTERS", "MODES", "Engine", "GenerationResult", "SamplingParams", "SpecConfig",
           "TokenLogprob", "default_drafter"]
