"""The sampler against independent references.

The per-token distribution the sampler draws from is compared with the one transformers' logits
processors produce from the same logits (temperature, top-k, top-p, min-p, repetition penalty, the
min-new-tokens EOS ban) and with a plain-Python transcription of OpenAI's presence/frequency
penalty formula, which transformers does not implement. Equality is up to float32 rounding
(atol 1e-6 on probabilities that sum to 1: both sides do a handful of float32 ops per logit).

Then the draws themselves: many seeded and unseeded draws from one distribution must have the
frequencies of the reference distribution (Pearson chi-square, false-alarm rate 1e-3 per test for
an arbitrary choice of seeds; with the fixed seeds here the outcome is deterministic), and never a
token the reference gives probability 0.

Logprobs are checked against transformers' own scores for the same tokens in `test_logprobs.py`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from streamer.request import Sequence
from streamer.sampler import Sampler
from streamer.sampling_params import SamplingParams

VOCAB = 48
EOS = 2
PROMPT = [5, 9, 9, 17, 30, 41]
OUTPUT = [9, 17, 17, 17, 44, 3]
ALPHA = 1e-3


def make_seq(params: SamplingParams, prompt: list[int] = PROMPT, output: list[int] = OUTPUT,
             index: int = 0) -> Sequence:
    return Sequence(request_id="r", index=index, token_ids=list(prompt) + list(output),
                    num_prompt_tokens=len(prompt), params=params, detokenizer=None)


def random_logits(seed: int, rows: int = 1, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * scale


def openai_penalties(logits: list[float], output: list[int], presence: float, frequency: float) -> list[float]:
    """OpenAI's documented formula, over the generated tokens only:
    mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty."""
    counts = Counter(output)
    return [mu - counts[j] * frequency - (1.0 if counts[j] > 0 else 0.0) * presence for j, mu in enumerate(logits)]


def reference_probs(logits: torch.Tensor, p: SamplingParams, prompt: list[int] = PROMPT,
                    output: list[int] = OUTPUT) -> torch.Tensor:
    """One row's sampling distribution from transformers' processors, in the engine's documented
    order: penalties, then temperature, min-p, top-k, top-p."""
    input_ids = torch.tensor([list(prompt) + list(output)])
    scores = logits[None].clone().double()
    processors = LogitsProcessorList()
    if p.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, [EOS] + p.stop_token_ids))
    if p.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    scores = processors(input_ids, scores)
    if p.presence_penalty or p.frequency_penalty:
        scores = torch.tensor([openai_penalties(scores[0].tolist(), list(output), p.presence_penalty,
                                                p.frequency_penalty)], dtype=torch.float64)
    warpers = LogitsProcessorList()
    if p.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(p.temperature))
    if p.min_p > 0:
        warpers.append(MinPLogitsWarper(p.min_p))
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    return torch.softmax(warpers(input_ids, scores), dim=-1)[0].float()


CASES = {
    "temperature 0.5": SamplingParams(temperature=0.5),
    "temperature 0.7": SamplingParams(temperature=0.7),
    "temperature 1.6": SamplingParams(temperature=1.6),
    "top_k 1": SamplingParams(top_k=1),
    "top_k 3": SamplingParams(temperature=0.8, top_k=3),
    "top_k 10": SamplingParams(top_k=10),
    "top_p 0.3": SamplingParams(top_p=0.3),
    "top_p 0.9 temperature 1.3": SamplingParams(temperature=1.3, top_p=0.9),
    "min_p 0.05": SamplingParams(min_p=0.05),
    "min_p 0.3 temperature 0.6": SamplingParams(temperature=0.6, min_p=0.3),
    "min_p 1 keeps the top token": SamplingParams(min_p=1.0),
    "repetition 1.4": SamplingParams(repetition_penalty=1.4),
    "repetition 0.7": SamplingParams(repetition_penalty=0.7),
    "presence 1.5": SamplingParams(presence_penalty=1.5),
    "frequency 0.8": SamplingParams(frequency_penalty=0.8),
    "presence -1 frequency 0.5": SamplingParams(presence_penalty=-1.0, frequency_penalty=0.5),
    "frequency -0.7": SamplingParams(frequency_penalty=-0.7),
    "min_tokens bans eos and stop ids": SamplingParams(min_tokens=10, stop_token_ids=[7, 11]),
    "everything": SamplingParams(temperature=0.7, top_k=12, top_p=0.85, min_p=0.02, repetition_penalty=1.2,
                                 presence_penalty=0.4, frequency_penalty=0.3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_distribution_equals_transformers_processors(name: str) -> None:
    params = CASES[name]
    sampler = Sampler({EOS}, seed=0)
    for seed in range(5):
        logits = random_logits(seed)
        got = sampler.probabilities(logits, [make_seq(params)])[0]
        want = reference_probs(logits[0], params)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert ((got > 0) == (want > 0)).all(), "the supports differ"


def test_one_batch_mixes_every_case_row_by_row() -> None:
    """All cases in one batch: each row keeps its own parameters and its own history."""
    names = list(CASES)
    logits = random_logits(123, rows=len(names))
    histories = [OUTPUT[: i % len(OUTPUT)] for i in range(len(names))]
    seqs = [make_seq(CASES[n], output=h) for n, h in zip(names, histories)]
    got = Sampler({EOS}, seed=0).probabilities(logits, seqs)
    for row, (name, history) in enumerate(zip(names, histories)):
        want = reference_probs(logits[row], CASES[name], output=history)
        torch.testing.assert_close(got[row], want, atol=1e-6, rtol=0, msg=name)


def nucleus_logits(probs: list[float]) -> torch.Tensor:
    padded = probs + [1e-9] * (VOCAB - len(probs))
    return torch.tensor(padded).log()[None]


@pytest.mark.parametrize("top_p, kept", [
    (0.39, 1),   # the top token alone already covers top_p
    (0.4001, 2),  # 0.4 is just short: the token that crosses the threshold stays
    (0.6999, 2),
    (0.7001, 3),
    (0.95, 4),
    (1.0, VOCAB),
])
def test_top_p_keeps_the_token_that_crosses_the_threshold(top_p: float, kept: int) -> None:
    """The nucleus is the smallest set of most likely tokens whose mass reaches top_p."""
    logits = nucleus_logits([0.4, 0.3, 0.2, 0.1 - (VOCAB - 4) * 1e-9])
    params = SamplingParams(top_p=top_p)
    got = Sampler({EOS}, seed=0).probabilities(logits, [make_seq(params, output=[])])[0]
    assert int((got > 0).sum()) == kept
    torch.testing.assert_close(got, reference_probs(logits[0], params, output=[]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("k", [1, 2, 5, VOCAB - 1, VOCAB, VOCAB + 10])
def test_top_k_keeps_exactly_k_tokens(k: int) -> None:
    logits = random_logits(7)
    got = Sampler({EOS}, seed=0).probabilities(logits, [make_seq(SamplingParams(top_k=k))])[0]
    assert int((got > 0).sum()) == min(k, VOCAB)
    assert set(got.topk(min(k, VOCAB)).indices.tolist()) == set(logits[0].topk(min(k, VOCAB)).indices.tolist())


def test_greedy_rows_take_the_penalised_argmax_in_a_mixed_batch() -> None:
    logits = random_logits(11, rows=3)
    top = int(logits[0].argmax())
    logits[0, top + 1 if top + 1 < VOCAB else top - 1] = logits[0, top] - 0.1  # a close runner-up
    greedy_penalised = SamplingParams(temperature=0.0, presence_penalty=2.0)
    history = [top]  # the penalty must move the greedy choice off the raw argmax
    seqs = [make_seq(greedy_penalised, output=history), make_seq(SamplingParams(seed=3)),
            make_seq(SamplingParams(temperature=0.0))]
    tokens = Sampler({EOS}, seed=0)(logits, seqs).token_ids
    want0 = torch.tensor(openai_penalties(logits[0].tolist(), history, 2.0, 0.0)).argmax()
    assert tokens[0] == int(want0) != top
    assert tokens[2] == int(logits[2].argmax())


def draw_counts(params: SamplingParams, logits: torch.Tensor, draws: int, seeded: bool) -> torch.Tensor:
    """Token counts of `draws` independent draws from one row's distribution, made as one batch."""
    seqs = [make_seq(replace(params, seed=1000 + i) if seeded else params) for i in range(draws)]
    tokens = Sampler({EOS}, seed=42)(logits.expand(draws, VOCAB), seqs).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB)


def assert_frequencies_match(counts: torch.Tensor, probs: torch.Tensor) -> None:
    draws = int(counts.sum())
    assert int(counts[probs == 0].sum()) == 0, "drew a token the reference excludes"
    expected = probs.double() * draws
    # Pearson's test needs expected counts of at least ~5: pool the rare tokens into one bin.
    big = expected >= 5
    obs = counts[big].double().tolist() + [float(counts[~big].sum())]
    exp = expected[big].tolist() + [float(expected[~big].sum())]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = [e * sum(obs) / sum(exp) for e in exp]  # float dust: totals must agree exactly for scipy
    p_value = chisquare(obs, exp).pvalue
    assert p_value > ALPHA, f"draw frequencies do not follow the distribution (p = {p_value:.2e})"


@pytest.mark.parametrize("name", ["temperature 0.7", "top_p 0.9 temperature 1.3", "top_k 3", "everything",
                                  "presence -1 frequency 0.5"])
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_draw_frequencies_follow_the_reference(name: str, seeded: bool) -> None:
    params = CASES[name]
    logits = random_logits(5, scale=1.5)
    assert_frequencies_match(draw_counts(params, logits[0:1], 6000, seeded), reference_probs(logits[0], params))


def test_frequency_check_has_power() -> None:
    """The statistical check itself rejects a slightly wrong temperature (0.7 drawn, 0.8 claimed),
    so a passing frequency test means something."""
    logits = random_logits(5, scale=1.5)
    counts = draw_counts(SamplingParams(temperature=0.7), logits, 6000, seeded=True)
    with pytest.raises(AssertionError, match="do not follow"):
        assert_frequencies_match(counts, reference_probs(logits[0], SamplingParams(temperature=0.8)))


def test_seeded_draws_depend_only_on_seed_index_and_position() -> None:
    """Sample i of seed s draws what sample 0 of seed s + i draws, at the same output position,
    whatever else is in the batch; another position draws independently."""
    logits = random_logits(9, rows=4, scale=0.5)
    sampler = Sampler({EOS}, seed=0)
    a = sampler(logits[0:1], [make_seq(SamplingParams(seed=77), index=2)]).token_ids[0]
    b = sampler(logits[0:1], [make_seq(SamplingParams(seed=79), index=0)]).token_ids[0]
    assert a == b
    noisy = [make_seq(SamplingParams()), make_seq(SamplingParams(seed=77), index=2), make_seq(SamplingParams())]
    assert sampler(torch.stack([logits[1], logits[0], logits[2]]), noisy).token_ids[1] == a
    positions = {sampler(logits[0:1], [make_seq(SamplingParams(seed=77), output=OUTPUT[:k])]).token_ids[0]
                 for k in range(6)}
    assert len(positions) > 1
