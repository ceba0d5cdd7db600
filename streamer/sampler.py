"""Batched sampling: penalties, temperature, min-p, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from streamer_kernels.cpu_extension import load as cpu_kernels
from streamer_kernels.elementwise_cpu import argmax_cpu

from streamer.grammar import apply_masks
from streamer.penalties import apply_penalties, penalised_row
from streamer.random_stream import counter_uniforms, generator_uniforms
from streamer.request import Sequence
from streamer.spec_decode.rejection_sampler import settle, verify_group
from streamer.top_k_top_p import NUCLEUS_CANDIDATES, Rules, candidates

# Keys of the uniforms that decide whether a draft is kept: a stream apart from the draws' own.
_ACCEPT_SALT = 0x5BD1E995 << 32


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest index. On the CPU the compiled kernel: torch's argmax over 32 x 32k
    logits took ~1 ms of a 40 ms decode step, one core scanning element by element."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and cpu_kernels():
        return argmax_cpu(logits)
    return logits.argmax(dim=-1)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    beam_logprobs: list[torch.Tensor | None]  # full next-token log-probs, for beam-search rows
    # Per sequence, the drafts it kept before its token (speculative decoding); None: no drafts this step.
    accepted: list[list[int]] | None = None
    # The step's pooling sequences (embeddings, streamer/pooling.py), by seq_id: what their chunk adds to
    # their pool (a float32 vector on the CPU). Carried here, beside the sampled tokens, as the step's output.
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)


class Sampler:
    def __init__(self, eos_token_ids: set[int], seed: int, nucleus_candidates: int = NUCLEUS_CANDIDATES) -> None:
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator().manual_seed(seed)
        self.nucleus_candidates = nucleus_candidates

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """`logits` `[N, V]` (any float dtype), one row per sequence that samples this step."""
        raw = logits.float()
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:  # tokens the output's grammar does not allow next are never drawn
            raw = raw.clone() if raw is logits else raw
            apply_masks(raw, constrained, [seqs[i].grammar for i in constrained])  # type: ignore[misc]
        # Copied only for rows to penalise: `raw` also gives the logprobs, unpenalised (the copy of
        # 32 x 32k floats, 0.25 ms, was a third of a greedy step's sampling).
        penalised = raw
        if any(map(penalised_row, seqs)):
            penalised = apply_penalties(raw.clone(memory_format=torch.contiguous_format), seqs, self.eos_token_ids)
        greedy = [s.params.greedy for s in seqs]
        if all(greedy):
            tokens = argmax(penalised)
        else:
            tokens = self._sample(penalised, seqs)
            if any(greedy):
                rows = torch.tensor([i for i, g in enumerate(greedy) if g], device=tokens.device)
                tokens[rows] = argmax(penalised[rows])
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw, seqs, token_list), self._beam_logprobs(raw, seqs))

    def probabilities(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution each row's next token is drawn from (`[N, V]`, rows sum to 1): what
        `__call__` samples from for non-greedy rows, from the same candidate groups. Exposed so
        tests can hold it against an independent reference."""
        penalised = apply_penalties(logits.float().clone(memory_format=torch.contiguous_format), seqs,
                                    self.eos_token_ids)
        probs = torch.empty_like(penalised)
        for group in candidates(penalised, _rules(seqs, penalised), self.nucleus_candidates):
            probs[group.rows] = group.dense(penalised.shape[1])
        return probs

    def with_drafts(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> SamplerOutput:
        """Sequence i has `1 + len(drafts[i])` consecutive rows of `logits`: keep the drafts the
        rejection rule keeps (spec_decode/rejection_sampler.py), then one token. Sequences without
        drafts sample as `__call__` does."""
        first = [0]
        for draft in drafts:
            first.append(first[-1] + 1 + len(draft))
        plain = [i for i, d in enumerate(drafts) if not d]
        spec = [i for i, d in enumerate(drafts) if d]
        out = SamplerOutput([0] * len(seqs), [None] * len(seqs), [None] * len(seqs), [[] for _ in seqs])
        if plain:
            result = self(logits[[first[i] for i in plain]], [seqs[i] for i in plain])
            for j, i in enumerate(plain):
                out.token_ids[i], out.logprobs[i], out.beam_logprobs[i] = \
                    result.token_ids[j], result.logprobs[j], result.beam_logprobs[j]
        if spec:
            rows = [r for i in spec for r in range(first[i], first[i + 1])]
            verified = settle([drafts[i] for i in spec], *self._verify(logits[rows], seqs, drafts, spec))
            for j, i in enumerate(spec):
                out.accepted[i], out.token_ids[i] = verified.accepted[j], verified.tokens[j]  # type: ignore[index]
        return out

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], spec: list[int]
                ) -> tuple[list[bool], list[int]]:
        """Per row of the drafting sequences: whether its draft is kept, and the token drawn there."""
        row_seqs = [seqs[i] for i in spec for _ in range(len(drafts[i]) + 1)]
        offsets = [j for i in spec for j in range(len(drafts[i]) + 1)]
        draft = torch.tensor([t for i in spec for t in (*drafts[i], -1)], device=logits.device)
        x = logits.float()
        drawn = argmax(x)
        keep = drawn == draft
        sampled = torch.tensor([r for r, s in enumerate(row_seqs) if not s.params.greedy], dtype=torch.long)
        if sampled.numel():
            picked = [row_seqs[r] for r in sampled.tolist()]
            accept_u = self._uniforms(picked, x.device, [offsets[r] for r in sampled.tolist()], _ACCEPT_SALT)
            draw_u = self._uniforms(picked, x.device, [offsets[r] for r in sampled.tolist()])
            rows = sampled.to(x.device)
            for group in candidates(x[rows], _rules(picked, x), self.nucleus_candidates):
                kept, tokens = verify_group(group, draft[rows[group.rows]], accept_u[group.rows], draw_u[group.rows])
                keep[rows[group.rows]] = kept
                drawn[rows[group.rows]] = tokens
        return keep.tolist(), drawn.tolist()

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """A token for every row (greedy rows are overwritten by the caller), drawn by inverse CDF
        from one uniform per row."""
        uniforms = self._uniforms(seqs, logits.device)
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        for group in candidates(logits, _rules(seqs, logits), self.nucleus_candidates):
            tokens[group.rows] = group.draw(uniforms[group.rows])
        return tokens

    def _uniforms(self, seqs: list[Sequence], device: torch.device, offsets: list[int] | None = None,
                  salt: int = 0) -> torch.Tensor:
        """Unseeded rows draw from the sampler's generator (seeded by the engine seed); a seeded
        row's draw is a function of (seed + sample index, output position) only, so sample i of
        seed s draws what a single-sample request seeded s + i draws, however it is batched or
        wherever it is resumed. `offsets`: a draft row's position past the sequence's output;
        `salt`: another stream of the same keys."""
        uniforms = generator_uniforms(len(seqs), self.generator, device)
        seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None]
        if seeded:
            keys = [(seqs[i].params.seed + seqs[i].index) ^ salt for i in seeded]  # type: ignore[operator]
            positions = [seqs[i].num_output_tokens + (offsets[i] if offsets else 0) for i in seeded]
            uniforms[torch.tensor(seeded, device=device)] = counter_uniforms(keys, positions, device)
        return uniforms

    @staticmethod
    def _beam_logprobs(raw: torch.Tensor, seqs: list[Sequence]) -> list[torch.Tensor | None]:
        rows = [i for i, s in enumerate(seqs) if s.params.use_beam_search]
        result: list[torch.Tensor | None] = [None] * len(seqs)
        if rows:
            logprobs = torch.log_softmax(raw[rows], dim=-1).cpu()
            for j, row in enumerate(rows):
                result[row] = logprobs[j]
        return result

    @staticmethod
    def _logprobs(raw: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[dict[int, float] | None]:
        wanted = [s.params.logprobs for s in seqs]
        if all(k is None for k in wanted):
            return [None] * len(seqs)
        logprobs = torch.log_softmax(raw, dim=-1)
        k_max = max(k for k in wanted if k is not None)
        top_vals, top_ids = logprobs.topk(max(k_max, 1), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=raw.device)[:, None])[:, 0].tolist()
        result: list[dict[int, float] | None] = []
        for row, k in enumerate(wanted):
            if k is None:
                result.append(None)
                continue
            entry = dict(zip(top_ids[row, :k].tolist(), top_vals[row, :k].tolist()))
            entry[tokens[row]] = chosen[row]
            result.append(entry)
        return result



def _rules(seqs: list[Sequence], logits: torch.Tensor) -> Rules:
    vocab = logits.shape[1]
    device = logits.device
    params = [s.params for s in seqs]
    return Rules(
        temperature=torch.tensor([p.temperature or 1.0 for p in params], device=device),
        top_k=torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device),
        top_p=torch.tensor([p.top_p for p in params], device=device),
        min_p=torch.tensor([p.min_p for p in params], device=device),
    )
