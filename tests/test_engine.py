"""The engine: every mode's greedy output equals plain decoding; batching, stops and bad requests."""

import time
from dataclasses import replace

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel


@pytest.fixture(scope="module")
def model():
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, gdn_backend="torch")
    m.w["lm_head.weight"] = m.w["lm_head.weight"] * 50       # clear greedy margins
    return m


def prompts():
    rep = [5, 9, 17, 33, 2] * 4                                # repetitive: n-gram drafts hit
    return [rep, [7, 7, 8, 9, 1, 2, 3, 7, 7, 8], [100]]


@pytest.mark.parametrize("mode", ["bole", "tree-serial", "chain"])
def test_greedy_modes_equal_ar(model, mode):
    params = SamplingParams(max_tokens=24)
    # ar on the serial reference recurrence: a bug in the closed form cannot cancel out
    ar = Engine(model, SpecConfig(mode="ar"), gdn_backend="torch-serial").generate(
        prompts(), params, seed=0)
    spec = Engine(model, SpecConfig(mode=mode, depth=4, topk=3, budget=12)).generate(
        prompts(), params, seed=0)
    for a, s in zip(ar, spec):
        assert s.token_ids == a.token_ids and len(s.token_ids) == 24
        assert s.finish_reason == a.finish_reason == "length"
        assert sum(s.accepted) == 23                       # the first token comes from prefill
    assert ar[0].rounds == 23
    assert spec[0].rounds < ar[0].rounds                   # the repetitive prompt accepted drafts


def test_ar_decodes_in_place_as_the_serial_reference(model):
    """ar's GDN layers update the state pool in place (the decode step, no GDN commit): its
    output and the cache's states after it equal ar on the serial reference's copy commit."""
    params = SamplingParams(max_tokens=16)
    runs = []
    for backend in (None, "torch-serial"):
        engine = Engine(model, SpecConfig(mode="ar"), max_slots=3, gdn_backend=backend)
        runs.append((engine, engine.generate(prompts(), params, seed=0)))
    (inplace, got), (serial, want) = runs
    assert inplace.runner.gdn == "torch-decode"
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    r = inplace.new_request(9, prompts()[1], SamplingParams(max_tokens=5))
    s = serial.new_request(9, prompts()[1], SamplingParams(max_tokens=5))
    for engine, req in ((inplace, r), (serial, s)):
        engine.admit(req)
        for _ in range(3):
            engine.step([req])
    torch.testing.assert_close(inplace.cache.gdn_state[:, r.slot], serial.cache.gdn_state[:, s.slot],
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(inplace.cache.conv_state[:, r.slot],
                               serial.cache.conv_state[:, s.slot], rtol=1e-5, atol=1e-6)


def test_one_request_stops_early_the_others_go_on(model):
    ref = Engine(model, SpecConfig(mode="ar")).generate(prompts(), SamplingParams(max_tokens=12))
    stop_tok = ref[1].token_ids[3]
    params = [SamplingParams(max_tokens=12),
              SamplingParams(max_tokens=12, stop_token_ids=(stop_tok,)),
              SamplingParams(max_tokens=5)]
    engine = Engine(model, SpecConfig(depth=3, topk=2, budget=8), max_slots=3)
    res = engine.generate(prompts(), params, seed=0)
    first_stop = ref[1].token_ids.index(stop_tok)
    assert res[1].finish_reason == "stop" and res[1].token_ids == ref[1].token_ids[:first_stop + 1]
    assert res[0].token_ids == ref[0].token_ids and res[0].finish_reason == "length"
    assert res[2].token_ids == ref[2].token_ids[:5]
    assert engine.cache.num_free == 3                        # every slot given back


def test_sampled_generation_runs_and_is_seeded(model):
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16)
    e = Engine(model, SpecConfig(depth=3, topk=2, budget=8))
    a = e.generate(prompts(), p, seed=7)
    b = e.generate(prompts(), p, seed=7)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert all(len(r.token_ids) == 16 for r in a)


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    ([1] * 200, SamplingParams(max_tokens=100), "context"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2], SamplingParams(temperature=-1), "temperature"),
    ([1, 2], SamplingParams(temperature=1.0, top_p=2.0), "top_p"),
    ([1, 999], SamplingParams(), "token ids"),
])
def test_bad_requests(model, prompt, params, match):
    e = Engine(model, SpecConfig(), max_len=256)
    with pytest.raises(ValueError, match=match):
        e.generate([prompt], params)
    assert e.cache.num_free == 8                             # nothing leaked


def test_bad_spec_config(model):
    with pytest.raises(ValueError, match="mode"):
        Engine(model, SpecConfig(mode="magic"))
    with pytest.raises(ValueError, match="no MTP head"):
        Engine(model, SpecConfig(drafter="mtp"))
    with pytest.raises(ValueError, match="drafter must be one of"):
        Engine(model, SpecConfig(drafter="draft-model"))
    with pytest.raises(ValueError) as err:
        Engine(model, SpecConfig(drafter="draft"))
    assert str(err.value) == "the draft drafter needs a draft_model (--draft-model)"
    Engine(model, SpecConfig(drafter="draft"), draft_model=model)      # given: built
    Engine(model, SpecConfig(mode="ar", drafter="draft"))             # ar drafts nothing


def test_bole_bench_command(tmp_path, capsys):
    import json

    from bole.cli import main
    assert main(["bench", "--preset", "tiny", "--prompts", "2", "--prompt-len", "16",
                 "--max-tokens", "12", "--depth", "3", "--out", str(tmp_path), "--device", "cpu"]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert [f.startswith("bench-") and "tiny-random-float32-cpu" in f for f in files] == [True] * 2
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    modes = {r["mode"]: r for r in data["results"]}
    assert set(modes) == {"ar", "bole", "tree-serial", "chain"}
    assert all(modes[m]["agreement_with_ar"] == 1.0 for m in ("bole", "tree-serial", "chain"))
    out = capsys.readouterr().out
    assert "tok/s" in out and str(tmp_path) in out
    for r in data["results"]:
        assert r["syncs_per_round"] == 1.0 and r["batch"] == 2 and r["rounds"] > 0


def test_bole_bench_defaults_to_the_bundled_model_with_its_mtp_head(tmp_path, capsys):
    import json

    pytest.importorskip("tokenizers")
    from bole.cli import main
    assert main(["bench", "--prompts", "2", "--max-tokens", "10", "--modes", "ar", "bole",
                 "--out", str(tmp_path), "--device", "cpu"]) == 0
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert data["meta"]["model_name"] == "bundled" and data["meta"]["drafter"] == "mtp"
    assert data["meta"]["prompt_set"] == "code"
    bole = next(r for r in data["results"] if r["mode"] == "bole")
    assert bole["agreement_with_ar"] == 1.0 and bole["mean_accepted_tokens"] > 1.0


def test_bole_bench_runs_bole_under_the_budget_policy(tmp_path):
    """``bole bench --budget-policy global --shared-budget 2`` verifies at most one draft node
    per request each round (two requests, a root child each): at most 2 tokens a round."""
    import json

    pytest.importorskip("tokenizers")
    from bole.cli import main
    assert main(["bench", "--prompts", "2", "--max-tokens", "10", "--modes", "ar", "bole",
                 "--budget-policy", "global", "--shared-budget", "2", "--out", str(tmp_path),
                 "--device", "cpu"]) == 0
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert data["meta"]["budget_policy"] == "global" and data["meta"]["shared_budget"] == 2
    bole = next(r for r in data["results"] if r["mode"] == "bole")
    assert bole["agreement_with_ar"] == 1.0 and 1.0 < bole["mean_accepted_tokens"] <= 2.0


def test_an_engine_serves_one_batch_after_another(model):
    """Slots and static buffers are reused across generate calls without stale rows."""
    engine = Engine(model, SpecConfig(depth=3, topk=2, budget=8), max_slots=3)
    first = engine.generate(prompts(), SamplingParams(max_tokens=14), seed=0)
    again = engine.generate(prompts(), SamplingParams(max_tokens=14), seed=0)
    other = engine.generate(prompts()[::-1], SamplingParams(max_tokens=14), seed=0)
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    assert [r.rounds for r in again] == [r.rounds for r in first]
    assert [r.token_ids for r in other] == [r.token_ids for r in first][::-1]


def test_mixed_batch_greedy_request_equals_ar(model):
    """A greedy request decoded next to sampled ones gets plain greedy output."""
    greedy = SamplingParams(max_tokens=16)
    sampled = SamplingParams(temperature=1.0, max_tokens=16)
    ar = Engine(model, SpecConfig(mode="ar"), gdn_backend="torch-serial").generate(
        prompts()[:1], greedy, seed=0)[0].token_ids
    for mode in ("bole", "tree-serial", "chain"):
        engine = Engine(model, SpecConfig(mode=mode, depth=3, topk=2, budget=8), max_slots=3)
        res = engine.generate([prompts()[0], prompts()[1], prompts()[0]],
                              [greedy, sampled, greedy], seed=5)
        assert res[0].token_ids == ar and res[2].token_ids == ar


@pytest.fixture(scope="module")
def sampling_case():
    """A small-vocabulary model with a few dozen likely tokens, a prompt n-gram drafts hit, and
    plain sampling's first tokens over 768 requests."""
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, gdn_backend="torch")
    tensors = dict(m.w)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 8
    m = HybridModel(m.config, tensors, gdn_backend="torch")
    prompt = [5, 9, 17, 33, 2] * 4

    def emitted(spec, seed):
        engine = Engine(m, spec, max_slots=128, max_len=64)
        params = SamplingParams(temperature=1.0, max_tokens=3)
        return [r.token_ids for call in range(6)
                for r in engine.generate([prompt] * 128, params, seed=seed + call)]
    return emitted, emitted(SpecConfig(mode="ar"), 1000)


@pytest.mark.parametrize("mode", ["bole", "tree-serial", "chain"])
def test_sampled_speculation_follows_the_target_distribution(sampling_case, mode):
    """Chi-square homogeneity of the tokens emitted in the first rounds, speculative against
    plain sampling, over 768 requests each (temperature 1, fixed seeds)."""
    from scipy.stats import chi2_contingency
    emitted, ar = sampling_case
    spec = emitted(SpecConfig(mode=mode, depth=3, topk=3, budget=10), 2000)
    for pos in (1, 2):
        tokens = sorted({t[pos] for t in ar + spec})
        table = [[sum(t[pos] == v for t in run) for v in tokens] for run in (ar, spec)]
        # pool the rare tokens so that every expected count is at least 5
        common = [j for j, v in enumerate(tokens) if table[0][j] + table[1][j] >= 10]
        rare = [j for j in range(len(tokens)) if j not in common]
        rows = [[row[j] for j in common] + ([sum(row[j] for j in rare)] if rare else [])
                for row in table]
        assert len(rows[0]) >= 3
        p = chi2_contingency(rows).pvalue
        assert p > 1e-3, (mode, pos, p)


def test_replay_drafter_through_the_engine_equals_ar_and_accepts():
    """The replay drafter (a random MTP head whose proposals follow an acceptance profile)
    through the engine: every mode equals plain decoding and accepts drafts."""
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, mtp=True,
                           gdn_backend="torch")
    ps = [prompts()[0], prompts()[1]]
    params = SamplingParams(max_tokens=20)
    ar = [r.token_ids for r in Engine(m, SpecConfig(mode="ar")).generate(ps, params)]
    for mode in ("bole", "tree-serial", "chain"):
        spec = SpecConfig(mode=mode, drafter="replay", depth=4, topk=3, budget=12,
                          acceptance="qwen3-next-mtp")
        res = Engine(m, spec, max_slots=2).generate(ps, params, continuations=ar)
        assert [r.token_ids for r in res] == ar
        assert sum(r.mean_accepted_tokens for r in res) / 2 > 2.0, mode
    with pytest.raises(ValueError, match="acceptance profile"):
        Engine(m, SpecConfig(drafter="replay"))


def test_request_errors_name_the_prompt_and_count_the_parameter_sets(model):
    """The messages a caller reads: the engine's own check says "the prompt", ``generate``
    names the prompt by its index, and a parameter list of the wrong length says both counts."""
    e = Engine(model, SpecConfig(mode="ar"), max_len=256)
    with pytest.raises(ValueError) as err:
        e.check_request([], SamplingParams())
    assert str(err.value) == "the prompt is empty; give at least one token"
    with pytest.raises(ValueError) as err:
        e.generate([[1, 2], []], SamplingParams())
    assert str(err.value) == "prompt 1 is empty; give at least one token"
    with pytest.raises(ValueError) as err:
        e.generate([[1, 2]], [SamplingParams(), SamplingParams()])
    assert str(err.value) == "2 parameter sets for 1 prompts"
    assert e.cache.num_free == 8


def test_a_result_times_its_prefill_and_decode_within_the_call_and_has_no_unasked_logprobs(model):
    e = Engine(model, SpecConfig(depth=3, topk=2, budget=8))
    t0 = time.perf_counter()
    (res,) = e.generate([prompts()[0]], SamplingParams(max_tokens=12))
    wall = time.perf_counter() - t0
    assert res.prefill_s > 0 and res.decode_s > 0
    assert res.prefill_s + res.decode_s <= wall
    assert res.logprobs is None and res.cached_tokens == 0
    assert res.rounds == len(res.accepted) and sum(res.accepted) == 11   # the first from prefill


def test_generate_takes_more_prompts_than_a_schedulers_default_queue(model):
    e = Engine(model, SpecConfig(mode="ar"), max_slots=8, max_len=32)
    res = e.generate([[t % 100 + 1] for t in range(300)], SamplingParams(max_tokens=1))
    assert len(res) == 300 and all(len(r.token_ids) == 1 for r in res)
    assert e.cache.num_free == 8


def test_a_failed_admission_leaves_the_running_requests_their_slots(model):
    """A request let in unchecked that cannot fit fails its admission; the requests already
    running keep their slots and finish with the output they get alone."""
    from bole.cache import CacheFull
    from bole.engine.scheduler import Scheduler
    alone = Engine(model, SpecConfig(mode="ar"), max_len=64).generate(
        prompts()[:2], SamplingParams(max_tokens=10))
    e = Engine(model, SpecConfig(depth=3, topk=2, budget=8), max_slots=3, max_len=64)
    scheduler = Scheduler(e)
    running = [scheduler.submit(p, SamplingParams(max_tokens=10)) for p in prompts()[:2]]
    scheduler.step()
    bad = scheduler.submit([1] * 60, SamplingParams(max_tokens=30), checked=True)
    with pytest.raises(CacheFull):
        scheduler.step()
    assert bad.done.is_set() and e.cache.num_free == 1
    assert sorted(e.cache.used_slots) == sorted(h.request.slot for h in running)
    scheduler.run_until_idle()
    assert [h.result.token_ids for h in running] == [r.token_ids for r in alone]
    assert e.cache.num_free == 3


def test_any_generate_seed_and_any_request_seed_in_torchs_range_samples(model):
    """``generate(seed=)`` derives each request's seed from it (``bole generate --seed``): a
    large one (its derived seeds past 2**64) samples, reproducibly, as a request seed at either
    end of a torch generator's range does; one past the range is refused by name."""
    e = Engine(model, SpecConfig(depth=3, topk=2, budget=8), max_len=64)
    params = SamplingParams(temperature=1.0, max_tokens=6)
    big = [e.generate(prompts()[:2], params, seed=1 << 45) for _ in range(2)]
    assert [r.token_ids for r in big[0]] == [r.token_ids for r in big[1]]
    assert all(len(r.token_ids) == 6 for r in big[0])
    for seed in (-(1 << 63), (1 << 64) - 1):
        runs = [e.generate(prompts()[:1], replace(params, seed=seed))[0] for _ in range(2)]
        assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 6
    with pytest.raises(ValueError, match=r"^seed must be None or an integer in \[-2\*\*63"):
        e.generate(prompts()[:1], replace(params, seed=1 << 64))
    assert e.cache.num_free == 8


def test_a_long_prompt_reports_its_prefill_progress_up_to_its_length(model):
    """``on_prefill_chunk(done, total)`` (``bole generate``'s progress of a long prompt): called
    for a prompt past the batched prefill's 64 tokens, ending at its whole length."""
    e = Engine(model, SpecConfig(mode="ar"), max_slots=2, max_len=256)
    seen = []
    e.on_prefill_chunk = lambda done, total: seen.append((done, total))
    prompt = [(7 * i) % 100 + 1 for i in range(100)]
    (res,) = e.generate([prompt], SamplingParams(max_tokens=2))
    assert seen and seen[-1] == (100, 100) and all(t == 100 for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert len(res.token_ids) == 2
