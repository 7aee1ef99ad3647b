"""The GPU prefill path (fla's chunk_gated_delta_rule) against Bole's own exact path.

Skipped without CUDA and fla. Op level: fla's chunk kernel on one chain with grouped value heads
and an fp32 initial state, against the fp64 serial recurrence. Model level: prefill logits and the
committed GDN state of a tiny random model in fp32 with fla against the tree path (fla off).
"""

import pytest
import torch

from bole.ops.gdn.reference import chain_gdn_recurrent
from tests.oracle_imports import fla_unblocked

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need a GPU")


@pytest.fixture(autouse=True)
def _fla_unblocked():
    """The transformers-oracle test modules block fla for the whole process (so that
    transformers keeps its torch path); these tests need the real fla."""
    with fla_unblocked():
        yield


def _fla():
    return pytest.importorskip("fla.ops.gated_delta_rule").chunk_gated_delta_rule


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)])
def test_fla_chunk_matches_serial_reference(dtype, tol):
    chunk = _fla()
    gen = torch.Generator().manual_seed(0)
    T, Hk, Hv, d = 300, 2, 4, 128
    q, k = torch.randn(1, T, Hk, d, generator=gen), torch.randn(1, T, Hk, d, generator=gen)
    v = torch.randn(1, T, Hv, d, generator=gen)
    g = -torch.rand(1, T, Hv, generator=gen) * 2
    beta = torch.rand(1, T, Hv, generator=gen)
    h0 = torch.randn(1, Hv, d, d, generator=gen) * 0.1
    o_ref, s_ref = chain_gdn_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                       initial_state=h0.double(), use_qk_l2norm_in_kernel=True)
    dev = dict(device="cuda")
    o, s = chunk(q.to(dtype).cuda(), k.to(dtype).cuda(), v.to(dtype).cuda(), g=g.cuda(),
                 beta=beta.to(dtype).cuda(), initial_state=h0.cuda(), output_final_state=True,
                 use_qk_l2norm_in_kernel=True)
    print(f"fla chunk {dtype}: o rel err {rel(o.cpu(), o_ref):.2e}, state {rel(s.cpu(), s_ref):.2e}")
    assert o.device.type == dev["device"]
    assert rel(o.cpu(), o_ref) < tol and rel(s.cpu(), s_ref) < tol


def test_model_prefill_with_fla_matches_tree_path():
    _fla()
    from bole.models.presets import preset_config
    from bole.models.qwen3_hybrid import HybridModel
    model = HybridModel.random(preset_config("tiny"), dtype=torch.float32, device="cuda",
                               gdn_backend="triton")
    gdn = model.linear["linear_attention"]
    assert gdn.prefill_kernel is not None and model.chunked_prefill
    prompt = torch.randint(0, model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(1))
    from bole.engine.runner import ModelRunner
    runner = ModelRunner(model, model.new_cache(max_slots=2, max_len=256), "triton")
    cache = runner.cache
    results = []
    for kernel in (gdn.prefill_kernel, None):
        gdn.prefill_kernel = kernel
        slot = cache.allocate(201)
        logits = model.lm_head(runner.prefill(slot, prompt, chunk=64)[1])
        results.append((logits.float().cpu(), cache.gdn_state[:, slot].float().cpu().clone()))
        cache.free(slot)
    e_logits, e_state = rel(results[0][0], results[1][0]), rel(results[0][1], results[1][1])
    print(f"model prefill fla vs tree path (fp32): logits {e_logits:.2e}, GDN state {e_state:.2e}")
    assert e_logits < 5e-3 and e_state < 5e-3
