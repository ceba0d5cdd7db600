"""Which tokens each sampling row may draw, and with what weight: temperature, min-p, top-k, top-p.

No full-vocabulary sort. A row with a top-k, or whose min-p / top-p cut falls among its
`nucleus_candidates` most likely tokens (almost always, for a trained model), works on that many
tokens picked by selection (`topk`); a row with no rule at all, or whose nucleus is wider (a nearly
flat distribution), draws from the whole vocabulary in its own order, the nucleus cut by a weight
threshold found without sorting (kernels/nucleus.py). Weights are left unnormalised
(`exp((x - max) / T)`, zero where a rule removes the token): the draw and `probabilities`
normalise by the kept mass, and a row's weights are the same bits whatever else is in its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from streamer_kernels.cpu_extension import load as cpu_kernels
from streamer_kernels.elementwise_cpu import nucleus_weights_cpu
from streamer_kernels.nucleus import nucleus_weights_ref

NUCLEUS_CANDIDATES = 256


@dataclass
class Candidates:
    """Rows `rows` of a batch: their candidate tokens and weights."""

    rows: torch.Tensor  # [n] row indices into the batch
    ids: torch.Tensor | None  # [n, K] token ids, most likely first; None: the whole vocabulary in order
    weights: torch.Tensor  # [n, K]

    def draw(self, uniforms: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF draw with one uniform in (0, 1] per row: the first token whose cumulative
        weight reaches u * total. A token of weight zero adds nothing to the sum, so it is never
        the first to reach it."""
        cumulative = self.weights.cumsum(dim=-1)
        target = uniforms[:, None] * cumulative[:, -1:]
        index = torch.searchsorted(cumulative, target).clamp_(max=self.weights.shape[1] - 1)
        return (index if self.ids is None else self.ids.gather(1, index))[:, 0]

    def dense(self, vocab: int) -> torch.Tensor:
        """`[n, vocab]` probabilities, rows summing to 1."""
        probs = self.weights / self.weights.sum(dim=-1, keepdim=True)
        if self.ids is None:
            return probs
        return torch.zeros(probs.shape[0], vocab, device=probs.device).scatter_(1, self.ids, probs)


@dataclass
class Rules:
    """Per-row warpers, as tensors on the logits' device; top_k is `vocab` where off."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    def take(self, rows: torch.Tensor) -> Rules:
        return Rules(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows])

    def truncates(self, vocab: int) -> torch.Tensor:
        return (self.top_k < vocab) | (self.top_p < 1.0) | (self.min_p > 0.0)


def candidates(logits: torch.Tensor, rules: Rules, nucleus_candidates: int = NUCLEUS_CANDIDATES
               ) -> list[Candidates]:
    """Split the rows of `logits` (penalised, before temperature) into candidate groups. Each
    row's weights depend on that row alone, never on what else is in the batch: a top-k row's
    candidates are a prefix of any wider selection, and a row without one always starts from
    the same `nucleus_candidates`."""
    vocab = logits.shape[1]
    has_k = rules.top_k < vocab
    truncates = rules.truncates(vocab)
    groups = []
    whole = _rows(~truncates)
    if whole.numel():
        groups.append(_whole_vocabulary(_take(logits, whole), rules.temperature[whole], whole))
    ranked = _rows(has_k)
    if ranked.numel():
        groups.append(_truncated(_take(logits, ranked), rules.take(ranked), ranked, int(rules.top_k[ranked].max()))[0])
    nucleus = _rows(truncates & ~has_k)
    if nucleus.numel():
        group, covered = _truncated(_take(logits, nucleus), rules.take(nucleus), nucleus,
                                    min(vocab, nucleus_candidates))
        groups.append(_keep(group, covered))
        wide = nucleus[~covered]  # the nucleus reaches past the candidates: cut the whole row
        if wide.numel():
            groups.append(_whole_row_nucleus(logits[wide], rules.take(wide), wide))
    return [g for g in groups if g.rows.numel()]


def _rows(mask: torch.Tensor) -> torch.Tensor:
    return mask.nonzero()[:, 0]


def _take(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows' logits: the tensor itself when they are all of them (in order, as `_rows` gives
    them), since a gathered copy of a whole batch of rows costs as much as a pass over it."""
    return logits if rows.numel() == logits.shape[0] else logits[rows]


def _whole_vocabulary(logits: torch.Tensor, temperature: torch.Tensor, rows: torch.Tensor) -> Candidates:
    # One new [rows, vocab] tensor, updated in place: each pass over it costs ~1 ms at 64 x 32k.
    weights = torch.sub(logits, logits.max(dim=-1, keepdim=True).values)
    return Candidates(rows, None, weights.div_(temperature[:, None]).exp_())


def _truncated(logits: torch.Tensor, rules: Rules, rows: torch.Tensor, width: int
               ) -> tuple[Candidates, torch.Tensor]:
    """The `width` most likely tokens of each row with the rules applied, and whether each row's
    kept set provably lies among them."""
    vocab = logits.shape[1]
    values, ids = logits.topk(width, dim=-1)  # sorted: temperature keeps the order
    weights = ((values - values[:, :1]) / rules.temperature[:, None]).exp_()
    ranks = torch.arange(width, device=logits.device)[None, :]
    keep = (ranks < rules.top_k[:, None]) & (weights >= rules.min_p[:, None])
    weights = weights * keep
    # cumsum, not sum: its prefix is the same bits however wide the selection (a sum's order
    # of additions changes with its length).
    cumulative = weights.cumsum(dim=-1)
    total = cumulative[:, -1].clone()
    # top-p is taken of the mass left after top-k and min-p. A row with a top-k has all of it
    # here; a row without one only if min-p cut inside the candidates.
    local = (rules.top_k <= width) | keep[:, -1].logical_not() | (width == vocab)
    if not bool(local.all()):
        far = _rows(~local)
        total[far] = _mass(logits[far], rules.take(far))
    in_nucleus = ((cumulative - weights) < rules.top_p[:, None] * total[:, None]) | (rules.top_p[:, None] >= 1.0)
    covered = local | ((cumulative[:, -1] >= rules.top_p * total) & (rules.top_p < 1.0))
    return Candidates(rows, ids, weights * in_nucleus), covered


def _whole_row_nucleus(logits: torch.Tensor, rules: Rules, rows: torch.Tensor) -> Candidates:
    """Every token of each row, in vocabulary order, weighted where min-p and top-p keep it. The
    top-p cut is found without sorting the row (kernels/nucleus.py): a token is kept when the
    weight of the tokens strictly above it is below top_p of the total (ties kept or dropped together).
    On the CPU one compiled pass per row: the same steps as torch ops took eight passes over the
    batch, most of a flat-distribution top-p step's cost."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous() and cpu_kernels():
        return Candidates(rows, None, nucleus_weights_cpu(logits, rules.temperature, rules.top_p, rules.min_p))
    return Candidates(rows, None, nucleus_weights_ref(logits, rules.temperature, rules.top_p, rules.min_p))


def _mass(logits: torch.Tensor, rules: Rules) -> torch.Tensor:
    """Each row's whole-vocabulary weight left after min-p."""
    top = logits.max(dim=-1, keepdim=True).values
    weights = ((logits - top) / rules.temperature[:, None]).exp_()
    if bool((rules.min_p > 0).any()):
        weights *= weights >= rules.min_p[:, None]
    return weights.sum(dim=-1)


def _keep(group: Candidates, mask: torch.Tensor) -> Candidates:
    ids = None if group.ids is None else group.ids[mask]
    return Candidates(group.rows[mask], ids, group.weights[mask])
