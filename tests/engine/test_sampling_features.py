"""Penalties, logprobs and stop tokens under speculation: exact against plain decoding.

* the device's penalised logits of a forest equal a slow per-node reference on random trees;
* greedy output with each penalty equals plain decoding (ar) token for token in every mode;
* sampled output with penalties follows the penalised softmax of a plain forward (chi-square);
* logprobs equal ar's and log_softmax of a plain forward's logits in every mode.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.runner import ModelRunner
from bole.forest import DenseForest
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from bole.sampling_params import MAX_LOGPROBS
from bole.speculative.penalties import PenaltyCounts, penalize_forest

MODES = ["bole", "tree-serial", "chain"]


# ---------------------------------------------------------------- the slow reference

def penalised_reference(logit: float, count: int, in_prompt: bool, presence: float,
                        frequency: float, repetition: float) -> float:
    """One logit penalised by the definitions (HF repetition penalty, OpenAI presence and
    frequency penalties), in float64."""
    if count > 0 or in_prompt:
        logit = logit / repetition if logit > 0 else logit * repetition
    return logit - frequency * count - presence * (1.0 if count > 0 else 0.0)


def random_forest(rng: random.Random, R: int, T: int, max_depth: int):
    """Random trees (parents before children, depth <= max_depth) and padding slots."""
    parents = torch.full((R, T), -1, dtype=torch.int64)
    valid = torch.zeros(R, T, dtype=torch.bool)
    for r in range(R):
        n = rng.randint(1, T)
        depth = [0]
        valid[r, 0] = True
        for i in range(1, n):
            choices = [j for j in range(i) if depth[j] < max_depth]
            p = rng.choice(choices)
            parents[r, i] = p
            depth.append(depth[p] + 1)
            valid[r, i] = True
    return parents, valid


def test_penalize_forest_equals_a_per_node_reference():
    """Every node of random forests over a vocabulary of 6 (so path tokens repeat and meet the
    committed counts and the prompt): penalised logits equal the per-node walk over parents."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    R, T, V, D = 5, 9, 6, 4
    for trial in range(6):
        parents, valid = random_forest(rng, R, T, D)
        forest = DenseForest.from_parents(parents, valid, D)
        tokens = torch.randint(0, V, (R, T), generator=gen)
        logits = torch.randn(R, T, V, generator=gen) * 3
        counts = torch.randint(0, 3, (R, V), generator=gen).float()
        prompt = torch.rand(R, V, generator=gen) < 0.3
        presence = torch.tensor([0.0, 0.7, -1.2, 2.0, 0.0])
        frequency = torch.tensor([0.0, 0.3, 0.5, -2.0, 0.0])
        repetition = torch.tensor([1.0, 1.5, 0.8, 1.3, 1.0])
        got = penalize_forest(logits, tokens, forest, counts, prompt, presence, frequency,
                              repetition)
        for r in range(R):
            for i in range(T):
                path, node = [], i
                while valid[r, i] and parents[r, node] >= 0:   # up to the root, which is counted
                    path.append(int(tokens[r, node]))
                    node = int(parents[r, node])
                for v in range(V):
                    want = penalised_reference(
                        float(logits[r, i, v]), int(counts[r, v]) + path.count(v),
                        bool(prompt[r, v]), float(presence[r]), float(frequency[r]),
                        float(repetition[r]))
                    assert math.isclose(float(got[r, i, v]), want, rel_tol=1e-6,
                                        abs_tol=1e-6), (trial, r, i, v)
        # neutral rows are the logits, bit for bit
        assert torch.equal(got[[0, 4]], logits[[0, 4]])


def test_penalty_counts_add_counts_the_emitted_tokens():
    pc = PenaltyCounts(3, 5, "cpu")
    pc.start(1, [0, 0, 4], first=2)
    assert pc.counts[1].tolist() == [0, 0, 1, 0, 0] and pc.prompt[1].tolist() == [
        True, False, False, False, True]
    pc.add(torch.tensor([1, 2], dtype=torch.int32), torch.tensor([[3, 3, 2, -1], [1, -1, -1, -1]]),
           torch.tensor([3, 0]))
    assert pc.counts[1].tolist() == [0, 0, 2, 2, 0] and pc.counts[2].tolist() == [0] * 5


# ---------------------------------------------------------------- engine: greedy

from tests.test_engine import model, prompts  # noqa: E402,F401  (the tiny model, its prompts)


PENALTIES = [dict(repetition_penalty=1.3), dict(repetition_penalty=0.7),
             dict(frequency_penalty=1.5), dict(presence_penalty=2.0, frequency_penalty=-0.5),
             dict(presence_penalty=-2.0, repetition_penalty=1.2, frequency_penalty=0.4)]


def plain_logits(model: HybridModel, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), V]`` logits after each prefix, from one plain (chain) forward in a fresh
    cache: no tree, no speculation, no sampling code."""
    cache = model.new_cache(1, len(tokens) + 8)
    runner = ModelRunner(model, cache, "torch")
    slot = cache.allocate(len(tokens))
    _, hidden = runner.prefill(slot, torch.tensor(tokens))
    return model.lm_head(hidden).float()


def last_logits(model: HybridModel, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's last logits ``[V]`` from plain batched prefills (16 rows at a time) into
    fresh caches."""
    rows = []
    for lo in range(0, len(seqs), 16):
        part = seqs[lo:lo + 16]
        cache = model.new_cache(len(part), max(map(len, part)) + 40)
        runner = ModelRunner(model, cache, "torch")
        slots = [cache.allocate(len(q)) for q in part]
        logits, _ = runner.prefill_batch(slots, [torch.tensor(q) for q in part])
        rows.extend(logits.float())
    return rows


@pytest.fixture(scope="module")
def replay_model():
    return HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, mtp=True,
                              gdn_backend="torch")


def test_greedy_penalties_equal_plain_decoding_in_every_mode(replay_model):
    """Each penalty changes the output (checked), and every mode's output equals ar's, token for
    token. The replay drafter proposes ar's output, so long paths are accepted and the counts of
    the tokens on a node's path decide its argmax (counting only the committed output fails
    this test for the penalties that favour repeats)."""
    for pen in PENALTIES:
        params = SamplingParams(temperature=0, **pen, max_tokens=24)
        ar_engine = Engine(replay_model, SpecConfig(mode="ar"))
        plain = [r.token_ids for r in ar_engine.generate(prompts(), SamplingParams(max_tokens=24))]
        ar = [r.token_ids for r in ar_engine.generate(prompts(), params)]
        assert ar != plain, pen
        for mode in MODES:
            spec = SpecConfig(mode=mode, drafter="replay", depth=4, topk=3, budget=12,
                              acceptance="qwen3-next-mtp")
            res = Engine(replay_model, spec, max_slots=3).generate(prompts(), params,
                                                                   continuations=ar)
            assert [r.token_ids for r in res] == ar, (mode, pen)
            assert sum(r.mean_accepted_tokens for r in res) / 3 > 2.0, (mode, pen)


def test_greedy_penalties_with_ngram_drafts_equal_plain_decoding(model):
    """The host (n-gram) drafter's trees with penalties: equal to ar in every mode."""
    params = SamplingParams(temperature=0, presence_penalty=-2.0, frequency_penalty=0.4,
                            repetition_penalty=1.2, max_tokens=24)
    ar = Engine(model, SpecConfig(mode="ar")).generate(prompts(), params, seed=0)
    for mode in MODES:
        spec = Engine(model, SpecConfig(mode=mode, depth=4, topk=3, budget=12)).generate(
            prompts(), params, seed=0)
        assert [r.token_ids for r in spec] == [r.token_ids for r in ar], mode
        assert sum(r.rounds for r in spec) < sum(r.rounds for r in ar), mode


def test_greedy_penalised_output_follows_the_definition(model):
    """ar's penalised greedy output is the argmax of the reference penalties applied to a plain
    forward's logits, at every position (independent of the engine's penalty code)."""
    sp = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.8,
                        repetition_penalty=1.4, max_tokens=16)
    prompt = prompts()[1]
    out = Engine(model, SpecConfig(mode="ar")).generate([prompt], sp)[0].token_ids
    logits = plain_logits(model, prompt + out[:-1])[len(prompt) - 1:]
    for j, tok in enumerate(out):
        row = [penalised_reference(float(x), out[:j].count(v), v in prompt, 0.5, 0.8, 1.4)
               for v, x in enumerate(logits[j].tolist())]
        assert tok == max(range(len(row)), key=row.__getitem__), j


def test_mixed_batch_penalised_and_plain_rows(model):
    """Penalised, plain greedy and sampled requests in one batch: the greedy ones equal ar's
    outputs with their own parameters."""
    pen = SamplingParams(temperature=0, frequency_penalty=1.0, max_tokens=16)
    plain = SamplingParams(max_tokens=16)
    sampled = SamplingParams(temperature=1.0, presence_penalty=1.0, max_tokens=16)
    ar = Engine(model, SpecConfig(mode="ar")).generate([prompts()[0]] * 2, [pen, plain])
    for mode in MODES:
        res = Engine(model, SpecConfig(mode=mode, depth=3, topk=2, budget=8), max_slots=3)\
            .generate([prompts()[0], prompts()[0], prompts()[1]], [pen, plain, sampled], seed=5)
        assert res[0].token_ids == ar[0].token_ids and res[1].token_ids == ar[1].token_ids


# ---------------------------------------------------------------- engine: logprobs

@pytest.mark.parametrize("mode", ["ar"] + MODES)
def test_logprobs_equal_plain_forward_in_every_mode(model, mode):
    """Each emitted token's logprob and top alternatives are log_softmax of a plain forward's
    logits at its position (raw distribution: penalties and temperature do not enter), and
    equal ar's; a request without logprobs gets None."""
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=20, logprobs=k)
              for k in (5, 0, None)]
    ar = Engine(model, SpecConfig(mode="ar")).generate(prompts(), params, seed=0)
    res = Engine(model, SpecConfig(mode=mode, depth=4, topk=3, budget=12)).generate(
        prompts(), params, seed=0)
    assert res[2].logprobs is None
    for prompt, r, a, k in zip(prompts(), res, ar, (5, 0)):
        assert r.token_ids == a.token_ids and len(r.logprobs) == len(r.token_ids)
        lp = torch.log_softmax(plain_logits(model, prompt + r.token_ids[:-1])
                               [len(prompt) - 1:].double(), dim=-1)
        for j, (tok, got, want) in enumerate(zip(r.token_ids, r.logprobs, a.logprobs)):
            assert got.token_id == tok and len(got.top) == k
            assert math.isclose(got.logprob, float(lp[j, tok]), abs_tol=1e-4)
            assert math.isclose(got.logprob, want.logprob, abs_tol=1e-4)
            top = torch.topk(lp[j], k)
            assert [t for t, _ in got.top] == top.indices.tolist()
            for (_, v), w in zip(got.top, top.values.tolist()):
                assert math.isclose(v, w, abs_tol=1e-4)


def test_logprobs_follow_the_stop_string_cut_and_bounds(model):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1).validate()
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1).validate()
    with pytest.raises(ValueError, match="penalty"):
        SamplingParams(presence_penalty=2.5).validate()
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0).validate()
    with pytest.raises(ValueError, match="stop_token_ids"):
        Engine(model, SpecConfig(mode="ar")).generate(
            [[1, 2]], SamplingParams(stop_token_ids=(10 ** 6,)))


def test_stop_token_ids_stop_every_mode_with_logprobs(model):
    """A stop token inside an accepted path ends the output there, with its logprob."""
    ref = Engine(model, SpecConfig(mode="ar")).generate(
        [prompts()[0]], SamplingParams(max_tokens=20))[0].token_ids
    stop = ref[9]
    cut = ref[:ref.index(stop) + 1]
    params = SamplingParams(max_tokens=20, stop_token_ids=(stop,), logprobs=2)
    for mode in ["ar"] + MODES:
        r = Engine(model, SpecConfig(mode=mode, depth=4, topk=3, budget=12)).generate(
            [prompts()[0]], params)[0]
        assert r.token_ids == cut and r.finish_reason == "stop" and len(r.logprobs) == len(cut)


# ---------------------------------------------------------------- engine: sampled

def reference_probs(logits: torch.Tensor, output: list[int], prompt: list[int],
                    pen: dict) -> list[float]:
    """Softmax (temperature 1) of the reference-penalised logits, float64."""
    row = [penalised_reference(x, output.count(v), v in prompt, pen["presence_penalty"],
                               pen["frequency_penalty"], pen["repetition_penalty"])
           for v, x in enumerate(logits.double().tolist())]
    top = max(row)
    e = [math.exp(x - top) for x in row]
    return [x / sum(e) for x in e]


def test_sampled_penalties_follow_the_penalised_distribution():
    """Tokens 1 and 2 of 768 sampled requests (bole mode, temperature 1, every penalty on)
    against the exact marginals of the reference-penalised softmax over plain forwards
    (chi-square goodness of fit, rare tokens pooled)."""
    from scipy.stats import chisquare
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, gdn_backend="torch")
    tensors = dict(m.w)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 16
    m = HybridModel(m.config, tensors, gdn_backend="torch")
    prompt = [5, 9, 17, 33, 2] * 4
    pen = dict(presence_penalty=1.0, frequency_penalty=0.7, repetition_penalty=1.6)
    params = SamplingParams(temperature=1.0, **pen, max_tokens=3)
    engine = Engine(m, SpecConfig(mode="bole", depth=3, topk=3, budget=10), max_slots=128,
                    max_len=64)
    runs = [r.token_ids for call in range(6)
            for r in engine.generate([prompt] * 128, params, seed=300 + call)]
    # exact marginals of tokens 1 and 2 over every likely prefix
    p0 = reference_probs(plain_logits(m, prompt)[-1], [], prompt, pen)
    firsts = [t0 for t0, q in enumerate(p0) if q >= 1e-4]
    p1 = dict(zip(firsts, (reference_probs(row, [t0], prompt, pen) for t0, row in zip(
        firsts, last_logits(m, [prompt + [t0] for t0 in firsts])))))
    marg1, marg2 = [0.0] * len(p0), [0.0] * len(p0)
    pairs = []
    for t0 in firsts:
        for t1, q1 in enumerate(p1[t0]):
            marg1[t1] += p0[t0] * q1
            if p0[t0] * q1 >= 1e-4:
                pairs.append((t0, t1))
    for (t0, t1), row in zip(pairs, last_logits(m, [prompt + list(pair) for pair in pairs])):
        for t2, q2 in enumerate(reference_probs(row, [t0, t1], prompt, pen)):
            marg2[t2] += p0[t0] * p1[t0][t1] * q2
    for pos, marg in ((1, marg1), (2, marg2)):
        n = len(runs)
        observed = [sum(t[pos] == v for t in runs) for v in range(len(marg))]
        common = [v for v in range(len(marg)) if marg[v] * n >= 5]
        assert len(common) >= 3
        obs = [observed[v] for v in common] + [n - sum(observed[v] for v in common)]
        exp = [marg[v] * n for v in common]
        exp.append(n - sum(exp))
        assert exp[-1] >= 5 or obs[-1] < 5
        if exp[-1] < 5:                       # nothing left to pool: drop the empty bucket
            obs, exp = obs[:-1], exp[:-1]
        scale = sum(obs) / sum(exp)
        p = chisquare(obs, [e * scale for e in exp]).pvalue
        assert p > 1e-3, (pos, p)


# ---------------------------------------------------------------- GPU: captured rounds

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_penalties_and_logprobs_equal_eager_and_sync_once():
    """On a GPU: rounds with penalties and logprobs replay from CUDA graphs (no eager
    fallback), equal eager rounds token for token and logprob for logprob, greedy speculation
    equals ar, and a round synchronises with the host only once."""
    from bole.assets import BUNDLED_MODEL, code_prompts
    from tokenizers import Tokenizer
    model = HybridModel.from_pretrained(BUNDLED_MODEL, dtype=torch.float32, device="cuda")
    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    ps = [tok.encode(p).ids for p in code_prompts()[:3]]
    pen = [dict(temperature=0, frequency_penalty=0.8, repetition_penalty=1.3),
           dict(temperature=0.8, presence_penalty=1.0), dict(temperature=0)]
    params = [SamplingParams(**s, max_tokens=40, ignore_eos=True, logprobs=3) for s in pen]
    runs = {}
    for mode, graphs in (("ar", False), ("bole", False), ("bole", True), ("chain", True)):
        engine = Engine(model, SpecConfig(mode, "mtp", depth=6, topk=3, budget=16),
                        max_slots=4, max_len=512, cuda_graphs=graphs)
        runs[mode, graphs] = engine.generate(ps, params, seed=11)
        if graphs:
            stats = engine.rounds.graphs.stats
            assert stats["graph_replays"] > 0 and stats["eager_fallbacks"] == 0
    eager, captured = runs["bole", False], runs["bole", True]
    for e, c in zip(eager, captured):
        assert e.token_ids == c.token_ids
        assert [x.logprob for x in e.logprobs] == [x.logprob for x in c.logprobs]
    for mode in (("bole", True), ("chain", True)):
        for i in (0, 2):                                    # the greedy requests
            assert runs[mode][i].token_ids == runs["ar", False][i].token_ids, mode
            for x, y in zip(runs[mode][i].logprobs, runs["ar", False][i].logprobs):
                assert math.isclose(x.logprob, y.logprob, abs_tol=1e-3)
    engine = Engine(model, SpecConfig("bole", "mtp", depth=6, topk=3, budget=16), max_slots=4,
                    max_len=512)
    reqs = [engine.new_request(i, p, replace(q, seed=i))
            for i, (p, q) in enumerate(zip(ps, params))]
    for r in reqs:
        engine.admit(r)
    engine.step(reqs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            engine.step(reqs, prelaunch=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert engine.timings.syncs == engine.timings.rounds


def test_llm_api_takes_the_new_fields():
    """bole.LLM: penalties, stop_token_ids, ignore_eos and logprobs reach the engine (the API's
    SamplingParams is the engine's); the output equals plain decoding's with the same
    parameters."""
    from bole import LLM
    from bole import SamplingParams as ApiParams
    assert ApiParams is SamplingParams
    llm = LLM(max_batch=1, max_len=256, dtype="fp32")     # exact comparisons: fp32 on a GPU too
    eos = tuple(llm.model.config.eos_token_id)
    base = llm.generate("def add(a, b):", ApiParams(max_tokens=12))[0]
    stop = base.token_ids[6]
    sp = ApiParams(max_tokens=12, frequency_penalty=0.5, repetition_penalty=1.1,
                   stop_token_ids=[stop], ignore_eos=True, logprobs=2)
    assert sp.stop_token_ids == (stop,) and llm.engine.new_request(0, [1], sp).stop_ids == {stop}
    with_eos = llm.engine.new_request(0, [1], ApiParams(stop_token_ids=[stop]))
    assert with_eos.stop_ids == set(eos + (stop,))
    out = llm.generate("def add(a, b):", sp)[0]
    ar = Engine(llm.model, SpecConfig("ar", "mtp"), max_slots=1, max_len=256).generate(
        [out.prompt_token_ids], sp)[0]
    assert out.token_ids == ar.token_ids and len(out.logprobs) == len(out.token_ids)
    assert out.finish_reason == ar.finish_reason
    assert (out.token_ids[-1] == stop) == (out.finish_reason == "stop")
    for x, y in zip(out.logprobs, ar.logprobs):
        assert x.token_id == y.token_id and math.isclose(x.logprob, y.logprob, abs_tol=1e-4)


def test_cli_generate_takes_the_new_flags(capsys):
    """`bole generate --json` with penalties, stop tokens, ignore_eos and logprobs: every mode
    prints ar's tokens and logprobs."""
    import json

    from bole.cli import main
    base = ["generate", "--prompt", "def add(a, b):", "--max-tokens", "8", "--json",
            "--device", "cpu", "--frequency-penalty", "1.0", "--repetition-penalty", "1.2",
            "--ignore-eos", "--stop-token-id", "0", "--logprobs", "2"]
    got = {}
    for mode in ("ar", "bole"):
        assert main(base + ["--mode", mode]) == 0
        got[mode] = json.loads(capsys.readouterr().out)
    assert got["ar"]["token_ids"] == got["bole"]["token_ids"]
    for x, y in zip(got["ar"]["logprobs"], got["bole"]["logprobs"]):
        assert x["token_id"] == y["token_id"] and len(x["top"]) == 2
        assert math.isclose(x["logprob"], y["logprob"], abs_tol=1e-4)
    assert len(got["bole"]["logprobs"]) == len(got["bole"]["token_ids"])
    assert main(base[:-2] + ["--logprobs", "21"]) == 2
