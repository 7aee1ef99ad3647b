"""The linear-attention layer-type interface (bole.models.layers): the registry, and a second type
registered beside Gated DeltaNet — a twin of it under another ``layer_types`` name with state
pools of its own — that config parsing, tensor specs, sharding, the cache, the forward, the
commit and prefill take up with no change of theirs. A model that mixes the two types equals the
all-GDN model with the same weights."""

import numpy as np
import pytest
import torch

from bole.distributed import TPShard
from bole.engine.runner import ModelRunner
from bole.models.config import HybridConfig
from bole.models.layers import registry
from bole.models.layers.base import LinearAttention
from bole.models.layers.gdn import GatedDeltaNet
from bole.models.presets import PRESETS
from bole.models.qwen3_hybrid import HybridModel
from bole.models.sharding import shard_plan
from bole.models.weights import text_model_specs
from bole.tree import DraftTree, PackedForest


class TwinGDN(GatedDeltaNet):
    """Gated DeltaNet under another name, its states in pools of its own."""

    name = "twin_linear_attention"
    section = "twin"
    state_pool, conv_pool = "twin_state", "twin_conv_state"


GDN = GatedDeltaNet.name
TINY = [GDN, GDN, GDN, "full_attention"]
MIXED = [GDN, TwinGDN.name, GDN, "full_attention"]


@pytest.fixture
def twin(monkeypatch):
    monkeypatch.setitem(registry.LINEAR_ATTENTION_TYPES, TwinGDN.name, TwinGDN)


def config(layer_types) -> HybridConfig:
    return HybridConfig.from_dict(dict(PRESETS["tiny"], layer_types=layer_types))


def test_the_registry_names_its_types():
    for name, kind in registry.LINEAR_ATTENTION_TYPES.items():
        assert issubclass(kind, LinearAttention) and kind.name == name
    assert registry.LAYER_TYPES == (registry.FULL_ATTENTION, *registry.LINEAR_ATTENTION_TYPES)
    with pytest.raises(ValueError, match="unknown linear-attention layer type 'kda'"):
        registry.linear_attention_type("kda")
    with pytest.raises(ValueError, match="layer_types must list 4 entries"):
        config([GDN, "kda", GDN, "full_attention"])


def test_a_type_s_fields_read_as_the_config_s_own():
    c = config(TINY)
    (kind, own), = c.linear_attention
    assert kind == GDN and own.layers == (0, 1, 2) == c.linear_layers
    assert c.linear_num_value_heads == own.linear_num_value_heads == 4
    assert c.conv_dim == own.conv_dim and c.gdn_layers == (0, 1, 2)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        c.nope


def test_a_second_type_is_parsed_specified_and_sliced(twin):
    c = config(MIXED)
    assert [(k, own.layers) for k, own in c.linear_attention] == \
        [(GDN, (0, 2)), (TwinGDN.name, (1,))]
    assert text_model_specs(c) == text_model_specs(config(TINY))
    shard = TPShard(1, 2)
    for name in text_model_specs(c):
        assert shard_plan(c, name, shard) == shard_plan(config(TINY), name, shard), name


@pytest.mark.parametrize("backend", ["torch", "torch-serial"])
def test_a_model_mixing_two_types_equals_the_all_gdn_model(twin, backend):
    """Prefill, tree verification, the commit of an accepted path and a decode step."""
    models = [HybridModel.random(config(types), dtype=torch.float32, seed=4, gdn_backend=backend)
              for types in (TINY, MIXED)]
    assert set(models[1].linear) == {GDN, TwinGDN.name}
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128, (9,), generator=gen)
    trees = PackedForest.pack([DraftTree.random(7, 3, np.random.default_rng(2))])
    tokens = torch.randint(0, 128, (trees.num_nodes,), generator=gen)
    results = []
    for model in models:
        runner = ModelRunner(model, model.new_cache(2, 48), backend)
        slot = runner.cache.allocate(40)
        last, _ = runner.prefill(slot, prompt, chunk=4)
        batch, out = runner.verify([slot], trees, tokens)
        runner.commit_accepted(batch, out, [3])
        step = runner.decode([slot], torch.tensor([5]))
        results.append((runner.cache, [last, out.logits, step]))
    (all_gdn, want), (mixed, got) = results
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert set(mixed.pools) == {"gdn_state", "conv_state", "twin_state", "twin_conv_state"}
    for name, twin_name in (("gdn_state", "twin_state"), ("conv_state", "twin_conv_state")):
        torch.testing.assert_close(mixed.pools[name], all_gdn.pools[name][[0, 2]])
        torch.testing.assert_close(mixed.pools[twin_name], all_gdn.pools[name][[1]])
    assert mixed.host_lengths == all_gdn.host_lengths
