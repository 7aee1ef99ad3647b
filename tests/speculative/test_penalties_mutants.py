"""The penalty functions element by element against the definitions (float64 scalars, no tensor
code shared with what they check): :func:`apply_penalties` on every case of the definition,
:func:`penalize_params` on host lists, :class:`PenaltyCounts`' start and add, and
:func:`path_tokens` on a tree written out by hand."""

from __future__ import annotations

import itertools
import math

import torch

from bole.forest import DenseForest
from bole.speculative.penalties import PenaltyCounts, path_tokens
from bole.sampling_params import SamplingParams
from bole.speculative.sampling import apply_penalties, penalize_params
from tests.engine.test_sampling_features import penalised_reference

#: (presence, frequency, repetition) per row: each sign, a neutral row, and the bounds
ROWS = [(0.7, 0.3, 1.5), (-1.2, 0.5, 0.8), (2.0, -2.0, 1.3), (0.0, 0.0, 1.0), (-2.0, 2.0, 0.5)]
#: every case of the definition: logits either side of 0 and at 0 (and at 1), counts 0, 1 and
#: several, in the prompt or not
CASES = list(itertools.product([-2.5, -0.5, 0.0, 0.5, 1.0, 3.0], [0, 1, 3], [False, True]))


def test_apply_penalties_follows_the_definition_in_every_case():
    """Each row's parameters on every (logit, count, in prompt) case: equal to the definition;
    the neutral row is the logits bit for bit; bf16 logits give fp32."""
    R, V = len(ROWS), len(CASES)
    logits = torch.tensor([[c[0] for c in CASES]] * R)
    counts = torch.tensor([[float(c[1]) for c in CASES]] * R)
    prompt = torch.tensor([[c[2] for c in CASES]] * R)
    presence, frequency, repetition = (torch.tensor(col) for col in zip(*ROWS))
    got = apply_penalties(logits, counts, prompt, presence, frequency, repetition)
    assert got.shape == (R, V) and got.dtype == torch.float32
    for r, (pres, freq, rep) in enumerate(ROWS):
        for v, (logit, count, in_prompt) in enumerate(CASES):
            want = penalised_reference(logit, count, in_prompt, pres, freq, rep)
            assert math.isclose(float(got[r, v]), want, rel_tol=1e-6, abs_tol=1e-6), \
                (ROWS[r], CASES[v], float(got[r, v]), want)
    assert torch.equal(got[3], logits[3])
    half = apply_penalties(logits.bfloat16(), counts, prompt, presence, frequency, repetition)
    assert half.dtype == torch.float32


def test_apply_penalties_broadcasts_rows_over_nodes():
    """``[R, T, V]`` logits with per-row parameters ``[R, 1]`` and counts ``[R, 1, V]`` (the
    forest's shapes): every node of a row gets its row's penalties."""
    gen = torch.Generator().manual_seed(4)
    R, T, V = 3, 4, 7
    logits = torch.randn(R, T, V, generator=gen) * 2
    counts = torch.randint(0, 3, (R, 1, V), generator=gen).float()
    prompt = torch.rand(R, 1, V, generator=gen) < 0.4
    pres, freq, rep = (torch.tensor(col)[:, None] for col in zip(*ROWS[:R]))
    got = apply_penalties(logits, counts, prompt, pres, freq, rep)
    for r, t, v in itertools.product(range(R), range(T), range(V)):
        want = penalised_reference(float(logits[r, t, v]), int(counts[r, 0, v]),
                                   bool(prompt[r, 0, v]), *ROWS[r])
        assert math.isclose(float(got[r, t, v]), want, rel_tol=1e-6, abs_tol=1e-6), (r, t, v)


def test_penalize_params_counts_the_output_and_marks_the_prompt():
    """One request's logits penalised for host lists of output (with repeats) and prompt
    tokens: equal to the definition at every token; with no penalty on, the logits as they
    are."""
    gen = torch.Generator().manual_seed(2)
    V = 12
    logits = torch.randn(V, generator=gen) * 2
    logits[0] = 0.5                                   # a positive logit that repeats
    output, prompt = [3, 3, 5, 0, 3], [5, 7, 7, 11]
    for pres, freq, rep in ROWS:
        params = SamplingParams(presence_penalty=pres, frequency_penalty=freq,
                                repetition_penalty=rep)
        got = penalize_params(logits, output, prompt, params)
        assert got.shape == (V,)
        for v in range(V):
            want = penalised_reference(float(logits[v]), output.count(v), v in prompt,
                                       pres, freq, rep)
            assert math.isclose(float(got[v]), want, rel_tol=1e-6, abs_tol=1e-6), \
                ((pres, freq, rep), v)
    assert torch.equal(penalize_params(logits, output, prompt, SamplingParams()), logits)
    first = penalize_params(logits, [], prompt, SamplingParams(repetition_penalty=2.0))
    assert [v for v in range(V) if first[v] != logits[v]] == [5, 7, 11]
    no_prompt = penalize_params(logits, [3], [], SamplingParams(frequency_penalty=1.0))
    assert [v for v in range(V) if no_prompt[v] != logits[v]] == [3]


def test_penalty_counts_restart_a_reused_slot_and_count_token_zero():
    """A slot reused by a new request forgets the old one's counts and prompt; token 0 is
    counted like any other; other slots are untouched."""
    pc = PenaltyCounts(3, 5, "cpu")
    pc.start(0, [1], first=1)
    pc.start(2, [0, 3], first=4)
    pc.add(torch.tensor([2, 0]), torch.tensor([[0, 0, 4], [2, 1, 1]]), torch.tensor([3, 1]))
    assert pc.counts[2].tolist() == [2, 0, 0, 0, 2]
    assert pc.counts[0].tolist() == [0, 1, 1, 0, 0]
    pc.start(2, [2], first=0)
    assert pc.counts[2].tolist() == [1, 0, 0, 0, 0]
    assert pc.prompt[2].tolist() == [False, False, True, False, False]
    assert pc.counts[0].tolist() == [0, 1, 1, 0, 0] and pc.counts[1].tolist() == [0] * 5
    assert pc.prompt[0].tolist() == [False, True, False, False, False]
    pc.start(1, [], first=3)                          # no prompt tokens: nothing marked
    assert pc.prompt[1].tolist() == [False] * 5 and pc.counts[1].tolist() == [0, 0, 0, 1, 0]


def test_path_tokens_of_a_tree_written_out():
    """Each node's own token, then its ancestors' below the root, -1 past the root; roots and
    padding all -1; a forest of roots only still gets one column."""
    parents = torch.tensor([[-1, 0, 0, 1, 3, -1]])
    valid = torch.tensor([[True] * 5 + [False]])
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    got = path_tokens(tokens, DenseForest.from_parents(parents, valid, 3))
    assert got.tolist() == [[[-1, -1, -1], [11, -1, -1], [12, -1, -1], [13, 11, -1],
                             [14, 13, 11], [-1, -1, -1]]]
    roots = DenseForest.from_parents(torch.full((2, 2), -1), torch.ones(2, 2, dtype=torch.bool), 0)
    assert path_tokens(torch.tensor([[1, 2], [3, 4]]), roots).tolist() == [[[-1]] * 2] * 2
