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

Logprobs are checked against transformers' own scores for the same tokens in `test_logprobs.py`;
here, against a float64 log-softmax: per row in a mixed batch, and the full rows beam search gets.
Stated properties without a reference: unseeded draws depend on the sampler's seed and not on
torch's global RNG, and no tensor the sampler makes depends on torch's default device.
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
                    num_prompt_tokens=len(prompt), params=params)


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
    # min_tokens holds back every token that would stop the request: EOS is one unless ignore_eos.
    banned = ([] if p.ignore_eos else [EOS]) + p.stop_token_ids
    if p.min_tokens and banned:
        processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, banned))
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
    "top_k 0 is off": SamplingParams(temperature=0.9, top_k=0),
    "top_p 0.3": SamplingParams(top_p=0.3),
    "top_p 0.9 temperature 1.3": SamplingParams(temperature=1.3, top_p=0.9),
    "min_p 0.05": SamplingParams(min_p=0.05),
    "min_p 0.3 temperature 0.6": SamplingParams(temperature=0.6, min_p=0.3),
    "min_p 1 keeps the top token": SamplingParams(min_p=1.0),
    "repetition 1.4": SamplingParams(repetition_penalty=1.4),
    "repetition 0.7": SamplingParams(repetition_penalty=0.7),
    "repetition 2 (the largest allowed)": SamplingParams(repetition_penalty=2.0),
    "presence 1.5": SamplingParams(presence_penalty=1.5),
    "frequency 0.8": SamplingParams(frequency_penalty=0.8),
    "presence -1 frequency 0.5": SamplingParams(presence_penalty=-1.0, frequency_penalty=0.5),
    "frequency -0.7": SamplingParams(frequency_penalty=-0.7),
    "min_tokens bans eos and stop ids": SamplingParams(min_tokens=10, stop_token_ids=[7, 11]),
    "min_tokens with ignore_eos leaves eos alone": SamplingParams(min_tokens=10, stop_token_ids=[7], ignore_eos=True),
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


@pytest.mark.parametrize("top_p, kept", [(0.25, 1), (0.5, 2), (0.75, 3), (1.0, 4)])
def test_top_p_reached_exactly_needs_no_further_token(top_p: float, kept: int) -> None:
    """Four equally likely tokens (0.25 each, exact in float32): once the mass of the tokens
    already kept equals top_p exactly, the nucleus is complete and the next token is left out.
    transformers' TopPLogitsWarper agrees (it drops tokens whose ascending cumulative mass is <=
    1 - top_p)."""
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, [3, 8, 20, 33]] = 0.0
    params = SamplingParams(top_p=top_p)
    got = Sampler({EOS}, seed=0).probabilities(logits, [make_seq(params, output=[])])[0]
    want = reference_probs(logits[0], params, output=[])
    assert int((got > 0).sum()) == int((want > 0).sum()) == kept
    # Which of the tied tokens stay is arbitrary; their probabilities are not.
    torch.testing.assert_close(got.sort().values, want.sort().values, atol=1e-6, rtol=0)


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


def test_unseeded_draws_follow_the_sampler_seed_not_the_global_rng() -> None:
    """Rows without a seed draw from the sampler's own generator, seeded by the engine seed: two
    samplers made with the same seed draw the same tokens whatever else used torch's global RNG,
    and another seed draws others."""
    logits = random_logits(13, rows=64, scale=0.3)  # close to uniform: 64 draws pin the generator
    seqs = [make_seq(SamplingParams()) for _ in range(64)]
    draws = []
    with torch.random.fork_rng():  # leave the global RNG as the other tests expect it
        for sampler_seed, global_seed in [(5, 1), (5, 2), (6, 1)]:
            sampler = Sampler({EOS}, seed=sampler_seed)
            torch.manual_seed(global_seed)
            draws.append(sampler(logits, seqs).token_ids)
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]


def log_softmax_reference(row: torch.Tensor) -> list[float]:
    """log p_j = x_j - log(sum_i exp(x_i)), in float64."""
    x = row.double()
    return (x - torch.logsumexp(x, dim=0)).tolist()


def test_logprobs_follow_each_rows_own_request_in_a_mixed_batch() -> None:
    """Rows that asked for no logprobs get None, wherever they sit in the batch; the others get
    their own top-k of the raw distribution plus the chosen token, before any penalty or warper."""
    wanted = [None, 2, None, 0, 5]
    logits = random_logits(17, rows=len(wanted))
    seqs = [make_seq(SamplingParams(temperature=1.1, top_k=4, presence_penalty=1.0, logprobs=k, seed=i))
            for i, k in enumerate(wanted)]
    out = Sampler({EOS}, seed=0)(logits, seqs)
    assert len(out.logprobs) == len(wanted)
    for row, k in enumerate(wanted):
        entry = out.logprobs[row]
        if k is None:
            assert entry is None
            continue
        ref = log_softmax_reference(logits[row])
        token = out.token_ids[row]
        top = sorted(range(VOCAB), key=lambda j: ref[j], reverse=True)[:k]
        assert entry is not None and set(entry) == set(top) | {token}
        for j, value in entry.items():
            assert value == pytest.approx(ref[j], abs=1e-5)


def test_beam_rows_get_the_full_raw_log_distribution() -> None:
    """Beam-search rows carry every token's raw log-probability (beam search scores them all
    itself); the other rows carry None."""
    beam = [False, True, False, True]
    logits = random_logits(19, rows=len(beam))
    seqs = [make_seq(SamplingParams(use_beam_search=b, beam_width=2) if b else SamplingParams(seed=1))
            for b in beam]
    out = Sampler({EOS}, seed=0)(logits, seqs)
    assert len(out.beam_logprobs) == len(beam)
    for row, is_beam in enumerate(beam):
        got = out.beam_logprobs[row]
        if not is_beam:
            assert got is None
            continue
        assert got is not None and got.shape == (VOCAB,)
        assert got.tolist() == pytest.approx(log_softmax_reference(logits[row]), abs=1e-5)


def test_the_default_device_does_not_matter() -> None:
    """Every tensor the sampler makes is put on the logits' device. In the engine the logits live
    on the GPU while torch's default device is the CPU; a tensor made on the default device would
    not mix with them. Here the default device is switched to "meta" (tensors without data), so any
    such tensor cannot mix with the CPU logits: the outputs must be those of a normal run."""
    params = [
        SamplingParams(temperature=0.7, top_k=12, top_p=0.85, min_p=0.02, repetition_penalty=1.2,
                       presence_penalty=0.4, frequency_penalty=0.3, logprobs=3, seed=4),
        SamplingParams(temperature=0.0, min_tokens=10, stop_token_ids=[7], logprobs=1),
        SamplingParams(use_beam_search=True),
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=1.3, min_p=0.1),
    ]
    logits = random_logits(21, rows=len(params))
    seqs = [make_seq(p) for p in params]
    want = Sampler({EOS}, seed=0)(logits, seqs)
    want_probs = Sampler({EOS}, seed=0).probabilities(logits, seqs)
    sampler = Sampler({EOS}, seed=0)  # its generator is made on the CPU, as in the engine
    with torch.device("meta"):
        got = sampler(logits, seqs)
        got_probs = sampler.probabilities(logits, seqs)
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
    assert [t is None for t in got.beam_logprobs] == [t is None for t in want.beam_logprobs]
    for g, w in zip(got.beam_logprobs, want.beam_logprobs):
        if w is not None:
            assert g is not None and g.device == w.device and torch.equal(g, w)
    assert got_probs.device == want_probs.device and torch.equal(got_probs, want_probs)


NARROW = {
    "top_p 0.3": SamplingParams(top_p=0.3),
    "top_p 0.9 temperature 1.3": SamplingParams(temperature=1.3, top_p=0.9),
    "min_p 0.05": SamplingParams(min_p=0.05),
    "min_p 0.002 top_p 0.95": SamplingParams(min_p=0.002, top_p=0.95),
    "top_k 20 top_p 0.8": SamplingParams(top_k=20, top_p=0.8),
}


@pytest.mark.parametrize("width", [1, 3, 8, VOCAB])
@pytest.mark.parametrize("name", list(NARROW))
def test_nucleus_wider_or_narrower_than_the_candidates(name: str, width: int) -> None:
    """Rows without a top-k first look for their nucleus among `width` candidates; where it
    reaches further they are selected whole. Either way the distribution is the reference's."""
    params = NARROW[name]
    sampler = Sampler({EOS}, seed=0, nucleus_candidates=width)
    logits = torch.cat([random_logits(seed, scale=s) for seed in range(3) for s in (0.3, 3.0, 8.0)])
    got = sampler.probabilities(logits, [make_seq(params) for _ in range(len(logits))])
    for row in range(len(logits)):
        want = reference_probs(logits[row], params)
        torch.testing.assert_close(got[row], want, atol=1e-6, rtol=0, msg=f"row {row}")
        assert ((got[row] > 0) == (want > 0)).all(), "the supports differ"


@pytest.mark.parametrize("name", ["top_p 0.9 temperature 1.3", "min_p 0.002 top_p 0.95"])
def test_draws_past_narrow_candidates_follow_the_reference(name: str) -> None:
    params = NARROW[name]
    logits = random_logits(5, scale=1.5)
    seqs = [make_seq(replace(params, seed=1000 + i)) for i in range(6000)]
    tokens = Sampler({EOS}, seed=42, nucleus_candidates=3)(logits.expand(6000, VOCAB), seqs).token_ids
    assert_frequencies_match(torch.bincount(torch.tensor(tokens), minlength=VOCAB), reference_probs(logits[0], params))


def test_a_seeded_row_draws_the_same_in_any_batch() -> None:
    """The same seeded row alone and beside rows that widen its candidate selection (a larger
    top-k, rows without a top-k, greedy and unseeded rows) draws the same token at every position."""
    logits = random_logits(31, rows=6, scale=0.7)
    row = SamplingParams(temperature=0.9, top_k=7, top_p=0.9, min_p=0.01, seed=5)
    others = [SamplingParams(top_k=30), SamplingParams(top_p=0.5), SamplingParams(temperature=0.0),
              SamplingParams(), SamplingParams(min_p=0.2, seed=9)]
    sampler = Sampler({EOS}, seed=0, nucleus_candidates=4)
    drawn = set()
    for k in range(len(OUTPUT) + 1):
        alone = sampler(logits[0:1], [make_seq(row, output=OUTPUT[:k])]).token_ids[0]
        batch = [make_seq(p, output=OUTPUT[:k]) for p in others[:2]] + [make_seq(row, output=OUTPUT[:k])]
        batch += [make_seq(p, output=OUTPUT[:k]) for p in others[2:]]
        mixed = sampler(torch.cat([logits[1:3], logits[0:1], logits[3:]]), batch).token_ids[2]
        assert mixed == alone, f"position {k}"
        drawn.add(alone)
    assert len(drawn) > 1, "every position drew the same token: the test shows nothing"
