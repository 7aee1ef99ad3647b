"""The serving engine: the speculative round (engine.py), its device phases and graphs
(round.py, graphs.py), and the model runner (runner.py)."""

from bole.engine.engine import (DRAFTERS, MODES, Engine, GenerationParams, GenerationResult,
                                SpecConfig, TokenLogprob, default_drafter)

__all__ = ["DRAFTERS", "MODES", "Engine", "GenerationParams", "GenerationResult", "SpecConfig",
           "TokenLogprob", "default_drafter"]
