"""Pin our conventions to the ecosystem: on chains we must equal transformers' torch reference.

transformers swaps its torch GDN / conv functions for fla's / causal_conv1d's kernels whenever those
import; we block both imports first so the oracle is the plain torch code (docs/design.md section 4).
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.oracle_imports import block_fast_kernels

block_fast_kernels()  # transformers on its torch paths (tests/oracle_imports.py)

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

from bole.ops.conv import conv_state_commit, tree_conv1d  # noqa: E402
from bole.ops.gdn.closed_form import commit_factored, tree_gdn_closed_form  # noqa: E402
from bole.ops.gdn.common import prepare_gdn_tree_inputs  # noqa: E402
from bole.ops.gdn.reference import chain_gdn_recurrent  # noqa: E402
from bole.tree import PackedForest  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


#: Sentinel fla and causal_conv1d packages: every kernel transformers could take from them records
#: its name and raises. A fake dist-info makes them look installed to version checks too.
SENTINEL_FILES = {
    "sentinel_log.py": "CALLS = []\n\nclass Called(Exception):\n    pass\n",
    "fla/__init__.py": "from fla.ops.gated_delta_rule import *  # noqa\n",
    "fla/ops/__init__.py": "",
    "fla/ops/gated_delta_rule/__init__.py": """
        import sentinel_log

        def _sentinel(name):
            def call(*args, **kwargs):
                sentinel_log.CALLS.append(name)
                raise sentinel_log.Called(name)
            call.__name__ = name
            return call

        chunk_gated_delta_rule = _sentinel("fla.chunk_gated_delta_rule")
        fused_recurrent_gated_delta_rule = _sentinel("fla.fused_recurrent_gated_delta_rule")
        """,
    "causal_conv1d/__init__.py": """
        from fla.ops.gated_delta_rule import _sentinel

        causal_conv1d_fn = _sentinel("causal_conv1d.causal_conv1d_fn")
        causal_conv1d_update = _sentinel("causal_conv1d.causal_conv1d_update")
        """,
    "flash_linear_attention-0.6.0.dist-info/METADATA":
        "Metadata-Version: 2.1\nName: flash-linear-attention\nVersion: 0.6.0\n",
    "causal_conv1d-1.5.0.dist-info/METADATA":
        "Metadata-Version: 2.1\nName: causal-conv1d\nVersion: 1.5.0\n",
}

#: Run in a fresh interpreter with the sentinels importable: set up the oracle exactly as the
#: oracle tests do (import this module), call every function they take from transformers, then,
#: as a control, import transformers again without the block and call the same functions.
ORACLE_PROBE = """
import json, sys
import torch
import sentinel_log

def call_all(m):
    q = k = torch.randn(1, 3, 1, 4); v = torch.randn(1, 3, 1, 4)
    g, beta = -torch.rand(1, 3, 1), torch.rand(1, 3, 1)
    x, w = torch.randn(1, 4, 3), torch.randn(4, 2)
    calls = [lambda: m.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta),
             lambda: m.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta),
             lambda: m.causal_conv1d_fn(x, w, None, activation="silu"),
             lambda: m.causal_conv1d_update(x, torch.zeros(1, 4, 1), w, None, "silu")]
    for c in calls:
        try:
            c()
        except sentinel_log.Called:
            pass
    seen = list(sentinel_log.CALLS)
    sentinel_log.CALLS.clear()
    return seen

# the sentinel kernels held in the closures of transformers' wrappers: transformers 5 binds
# fla's kernel at import and calls it only for tensors on a GPU, so calls on the CPU cannot
# show the choice; what the wrapper holds does
def bound(m):
    found, todo, done = [], [getattr(m, n) for n in (
        "torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule", "causal_conv1d_fn",
        "causal_conv1d_update")], set()
    while todo:
        f = todo.pop()
        if id(f) in done or not callable(f):
            continue
        done.add(id(f))
        name = getattr(f, "__name__", "")
        if name.startswith(("fla.", "causal_conv1d.")):
            found.append(name)
        for cell in getattr(f, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:
                pass
        if hasattr(f, "__wrapped__"):
            todo.append(f.__wrapped__)
        if hasattr(type(f), "forward"):       # with `kernels` installed: a module around it
            todo.append(type(f).forward)
    return sorted(found)

from tests.ops import test_gdn_vs_transformers as oracle
with_block = call_all(oracle.qwen3_5) + bound(oracle.qwen3_5)
for name in [n for n in sys.modules if n.split(".")[0] in ("fla", "causal_conv1d")
             or n.startswith("transformers.models.qwen3_5")]:
    del sys.modules[name]
import transformers.models.qwen3_5.modeling_qwen3_5 as unblocked
print(json.dumps({"oracle": with_block, "control": call_all(unblocked) + bound(unblocked)}))
"""


def test_oracle_is_the_torch_path(tmp_path):
    """transformers wraps the kernels it picks with functools.wraps, so their names prove nothing:
    with a sentinel fla and causal_conv1d importable, the oracle set-up must neither call nor
    hold them, while transformers imported without the block calls or holds the sentinel fla
    (else the sentinel proves nothing and the test fails)."""
    for name, text in SENTINEL_FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    env_path = [str(tmp_path), str(ROOT)]
    out = subprocess.run([sys.executable, "-c", ORACLE_PROBE], capture_output=True, text=True,
                         cwd=ROOT, env={**__import__("os").environ,
                                        "PYTHONPATH": ":".join(env_path)}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["oracle"] == [], f"the oracle reached the sentinel kernels: {seen['oracle']}"
    assert "fla.fused_recurrent_gated_delta_rule" in seen["control"], \
        f"transformers without the block did not pick up the sentinel fla: {seen['control']}"


def test_input_preparation_matches_transformers():
    """The preparation every Bole GDN path shares (l2 norm of q and k, the query scale, the gates
    from raw a, b, A_log, dt_bias), read back from transformers' own code: through its torch
    recurrence (one token, an identity state, beta = 0: o is the prepared q; a zero state, beta =
    1, a one-hot v: the final state is the prepared k) and its GDN layer's gate computation."""
    gen = torch.Generator().manual_seed(0)
    N, H, d = 5, 3, 16
    q, k = torch.randn(1, N, H, d, generator=gen) * 3, torch.randn(1, N, H, d, generator=gen)
    a, b = torch.randn(1, N, H, generator=gen), 2 * torch.randn(1, N, H, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    forest = PackedForest.from_parents(torch.full((N, 1), -1))         # N one-node trees
    ours = prepare_gdn_tree_inputs(q, k, torch.zeros(1, N, H, d), forest, a=a, b=b, A_log=A_log,
                                   dt_bias=dt_bias, use_qk_l2norm_in_kernel=True)

    def hf_one_token(x, v, beta, state):
        o, s = qwen3_5.torch_recurrent_gated_delta_rule(
            x.reshape(N, 1, H, d), x.reshape(N, 1, H, d), v, g=torch.zeros(N, 1, H),
            beta=torch.full((N, 1, H), beta), initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        return o, s
    eye = torch.eye(d).expand(N, H, d, d)
    o, _ = hf_one_token(q, torch.zeros(N, 1, H, d), 0.0, eye)
    assert rel(ours.q, o.reshape(N, H, d)) <= 1e-6
    one_hot = torch.zeros(N, 1, H, 1)
    one_hot[..., 0] = 1.0
    _, s = hf_one_token(k, one_hot, 1.0, torch.zeros(N, H, d, 1))
    assert rel(ours.k, s[..., 0]) <= 1e-6

    layer = qwen3_5.Qwen3_5GatedDeltaNet(_tiny_text_config(H, d), layer_idx=0).eval()
    with torch.no_grad():
        layer.A_log.copy_(A_log)
        layer.dt_bias.copy_(dt_bias)
    seen = {}

    def capture(query, key, value, g, beta, **kwargs):
        seen.update(g=g, beta=beta)
        return torch.zeros_like(value), None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qwen3_5, "torch_chunk_gated_delta_rule", capture)
        mp.setattr(layer.in_proj_a, "forward", lambda x: a)
        mp.setattr(layer.in_proj_b, "forward", lambda x: b)
        with torch.no_grad():
            layer(torch.zeros(1, N, layer.in_proj_a.in_features))
    assert rel(ours.g, seen["g"].reshape(N, H)) <= 1e-6
    assert rel(ours.beta, seen["beta"].reshape(N, H)) <= 1e-6


def _tiny_text_config(heads: int, head_dim: int):
    """A transformers Qwen3.5 text config with one GDN layer of ``heads`` x ``head_dim``."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    return Qwen3_5TextConfig(hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"],
                             linear_num_key_heads=heads, linear_num_value_heads=heads,
                             linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             intermediate_size=64, vocab_size=32)


@pytest.mark.parametrize("B, T, H_k, H_v, d_k, d_v, l2", [
    (2, 16, 2, 4, 16, 8, True),
    (1, 33, 1, 1, 8, 8, False),
    (3, 8, 2, 6, 16, 16, True),
])
def test_chain_equals_transformers_recurrence(B, T, H_k, H_v, d_k, d_v, l2):
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(B, T, H_k, d_k, generator=gen)
    k = torch.randn(B, T, H_k, d_k, generator=gen)
    if not l2:
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, H_v, d_v, generator=gen)
    g = -torch.rand(B, T, H_v, generator=gen) * 4
    beta = torch.rand(B, T, H_v, generator=gen)
    S = torch.randn(B, H_v, d_k, d_v, generator=gen)
    # value head h reads key head h // (H_v / H_k); transformers 5.17's recurrence does not repeat
    # the key heads itself, so they are repeated here (a no-op for the versions that do)
    group = H_v // H_k
    o_hf, s_hf = qwen3_5.torch_recurrent_gated_delta_rule(
        q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2), v, g=g, beta=beta,
        initial_state=S.clone(), output_final_state=True, use_qk_l2norm_in_kernel=l2)
    o_ser, s_ser = chain_gdn_recurrent(q, k, v, g, beta, initial_state=S,
                                       use_qk_l2norm_in_kernel=l2)
    assert rel(o_ser, o_hf) <= 1e-6 and rel(s_ser, s_hf) <= 1e-6
    forest = PackedForest.from_parents(torch.arange(-1, T - 1).expand(B, T))
    o_cf, f = tree_gdn_closed_form(q, k, v, forest, g=g, beta=beta, initial_state=S,
                                   use_qk_l2norm_in_kernel=l2)
    assert rel(o_cf, o_hf) <= 1e-6
    s_cf = commit_factored(f, S, forest, [T - 1] * B)
    assert rel(s_cf, s_hf) <= 1e-6


def test_chain_conv_equals_transformers_conv_update():
    B, T, C, K = 2, 7, 12, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    state = torch.randn(B, C, K - 1, generator=gen)
    hf_state = state.clone()
    y_hf = qwen3_5.causal_conv1d_update(x.transpose(1, 2), hf_state, w, None, "silu")
    forest = PackedForest.from_parents(torch.arange(-1, T - 1).expand(B, T))
    y = tree_conv1d(x, w, state, forest)
    assert rel(y, y_hf.transpose(1, 2)) <= 1e-6
    assert torch.allclose(conv_state_commit(x, state, forest, [T - 1] * B), hf_state)
