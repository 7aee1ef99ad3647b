"""train/measure_acceptance.py: the rank shares and chain lengths it summarises, the ranks it
measures along on-path chains (also over a reduced draft vocabulary) and the published profile's
fit, on a tiny random model and hand-made ranks."""

import pytest
import torch

from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from bole.speculative.drafters.replay import chain_accept_length
from tests.scripts import load_script

DEPTH, RANKS = 3, 4


def _script():
    return load_script("train/measure_acceptance.py")


def _model() -> HybridModel:
    return HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=1, mtp=True,
                              gdn_backend="torch")


def _sequences(model, count: int = 3, length: int = 14) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()
            for _ in range(count)]
    return seqs, [6] * count


def test_summarise_counts_ranks_and_the_leading_run():
    m = _script()
    # three chains of depth 3; rank RANKS is a miss
    rank = torch.tensor([[0, 0, 1], [0, 4, 0], [2, 0, 0]])
    s = m.summarise(rank, RANKS)
    assert s["samples"] == 9 and s["chains"] == 3 and s["misses"] == 1
    assert s["counts_by_rank"] == [6, 1, 1, 0]
    assert s["rank_acceptance"] == [6 / 9, 1 / 9, 1 / 9, 0.0]
    assert [d["samples"] for d in s["per_depth"]] == [3, 3, 3]
    # leading runs of rank-0 hits: 2, 1, 0 -> 1 + mean = 2.0
    assert s["chain"]["measured_accept_length"] == 2.0
    assert s["chain"]["profile_accept_length"] == chain_accept_length(6 / 9, 3)


def test_ranks_are_in_range_and_a_draft_vocabulary_without_the_target_never_proposes_it():
    m = _script()
    model = _model()
    seqs, starts = _sequences(model)
    rank, row = m.measure_ranks(model, seqs, starts, DEPTH, RANKS)
    # roots at positions starts .. len - 1 - DEPTH of each sequence
    assert rank.shape == (3 * (14 - 1 - DEPTH - 6 + 1), DEPTH) and row.shape == rank.shape[:1]
    assert int(rank.min()) >= 0 and int(rank.max()) <= RANKS
    every = torch.arange(model.config.vocab_size)
    same, _ = m.measure_ranks(model, seqs, starts, DEPTH, RANKS, vocab_ids=every)
    assert torch.equal(same, rank)              # the whole vocabulary as a draft vocabulary
    used = torch.tensor(sorted({t for s in seqs for t in s}))
    others = every[~torch.isin(every, used)]
    assert len(others) >= RANKS
    none, _ = m.measure_ranks(model, seqs, starts, DEPTH, RANKS, vocab_ids=others)
    assert bool((none == RANKS).all())           # no target token can be proposed
    # drafting over only the sequences' own tokens, a random head hits them far more often
    # than over all 128 (9 of 45 against 2 on this seed): the restriction is applied
    own, _ = m.measure_ranks(model, seqs, starts, DEPTH, RANKS, vocab_ids=used)
    assert int((own < RANKS).sum()) > 2 * int((rank < RANKS).sum())


def test_the_vocabulary_sweep_reports_each_size():
    """Each size's row is the measurement over that draft vocabulary (a model without token
    counts drafts over its first ``size`` ids), the share of the greedy tokens inside it, and
    the replay model's tree length of its rank shares."""
    m = _script()
    model = _model()
    seqs, starts = _sequences(model)
    V = model.config.vocab_size
    full = m.summarise(m.measure_ranks(model, seqs, starts, DEPTH, RANKS)[0], RANKS)
    rows = m.vocab_sweep(model, seqs, starts, DEPTH, RANKS, [V // 4], full)
    assert [r["draft_vocab"] for r in rows] == [V, V // 4]
    assert rows[0]["rank_acceptance"] == full["rank_acceptance"]
    assert rows[0]["greedy_tokens_inside"] == 1.0
    generated = torch.cat([torch.tensor(s[st:]) for s, st in zip(seqs, starts)])
    assert rows[1]["greedy_tokens_inside"] == float((generated < V // 4).double().mean())
    quarter = m.summarise(m.measure_ranks(model, seqs, starts, DEPTH, RANKS,
                                          vocab_ids=torch.arange(V // 4))[0], RANKS)
    assert rows[1]["rank_acceptance"] == quarter["rank_acceptance"]
    assert rows[1]["chain_accept_length"] == quarter["chain"]["measured_accept_length"]
    profile = m.AcceptanceProfile("t", "t", tuple(quarter["rank_acceptance"]))
    assert rows[1]["tree_accept_length"] == profile.tree_accept_length(DEPTH, 4, 32)


def test_the_sweep_s_arguments_are_checked():
    m = _script()
    with pytest.raises(SystemExit):
        m.main(["--vocab-out", "x.json"])                 # no sizes to sweep
    with pytest.raises(SystemExit):
        m.main(["--draft-vocab", "4", "--ranks", "8"])    # fewer tokens than proposals


def test_the_published_fit_meets_the_mean_published_length():
    m = _script()
    shape = [0.77, 0.09, 0.04, 0.02]
    fit = m.fit_published(shape)
    p = fit["rank_acceptance"]
    mean = sum(m.PUBLISHED.values()) / len(m.PUBLISHED)
    assert abs(chain_accept_length(p[0], m.PUBLISHED_STEPS) - mean) < 1e-5
    assert sum(p) <= 1.0 and all(x >= 0 for x in p)
    # ranks >= 2 keep the measured head's shares of rank-1 misses
    for i in (1, 2, 3):
        assert abs(p[i] / (1 - p[0]) - shape[i] / (1 - shape[0])) < 1e-4
