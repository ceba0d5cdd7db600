"""One scheduled step as plain integers (the format rank 0 sends the other tensor-parallel ranks)
and the tensors the model runs on, built from it."""

from __future__ import annotations

import array
from dataclasses import dataclass, field

import torch

from streamer.attention.backend import AttentionMetadata
from streamer.lora.request import LoRARequest
from streamer.request import Sequence
from streamer.scheduler_output import ScheduledSeq

# The header of a flattened step: sizes of the payload's sections, then the step's maxima.
HEADER = ("num_tokens", "num_seqs", "table_width", "num_samples", "num_copies", "num_decodes",
          "max_query_len", "max_seq_len", "max_decode_seq_len", "num_pool_rows", "pool_every_row")
HEADER_LEN = len(HEADER)


@dataclass
class FlatStep:
    """One step as plain integers: what rank 0 sends the other tensor-parallel ranks.

    `payload` concatenates input ids, positions, slots (`num_tokens` each), query_start_loc
    (`num_seqs + 1`), seq_lens (`num_seqs`), block tables (`num_seqs x table_width`, padded with
    0), sample rows (`num_samples`), block copies (`num_copies` (src, dst) pairs) and pool rows
    (`num_pool_rows`: the rows whose final hidden states embeddings pool, streamer/pooling.py)."""

    header: list[int]
    payload: list[int]
    sample_seqs: list[Sequence]  # rank 0 only: who samples from each sample row (a drafting sequence: its first)
    drafts: list[list[int]]  # rank 0 only: per sample_seqs entry, its drafts, whose rows follow its first
    # rank 0 only: each attention row's adapter (None: the base model) and token count, in flat order
    row_loras: list[tuple[LoRARequest | None, int]] = field(default_factory=list)
    # rank 0 only: each pooling sequence of the step and how many pool rows it has, in pool-row order
    pool_seqs: list[tuple[Sequence, int]] = field(default_factory=list)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # index into the flat tokens of each sequence's last new token
    block_copies: torch.Tensor  # [C, 2] (src, dst), done before the model runs
    # index into the flat tokens of the rows pooled for embeddings (empty: none this step)
    pool_rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    # a pool row is not the last of its chunk (mean pooling): the last layer must compute every row
    pool_every_row: bool = False


def sample_rows_meta(meta: AttentionMetadata, rows: torch.Tensor) -> AttentionMetadata:
    """The sample rows as a decode batch: each is the last new token of its sequence, so after the
    step's K/V are written it attends to its sequence's whole context, `seq_lens` keys, as a decode
    does (the last layer computes only these rows past its K/V: models/llama.py)."""
    seq = torch.searchsorted(meta.query_start_loc[1:], (rows + 1).to(torch.int32))  # qsl[seq + 1] == row + 1
    n = rows.shape[0]
    return AttentionMetadata(
        num_decodes=n,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=rows.device),
        seq_lens=meta.seq_lens[seq],
        slot_mapping=meta.slot_mapping[rows],
        block_tables=meta.block_tables[seq],
        max_query_len=min(n, 1),
        max_seq_len=meta.max_seq_len,  # a bound (no device sync): decode kernels take one
        max_decode_seq_len=meta.max_seq_len,
    )


def _rows(item: ScheduledSeq) -> list[tuple[list[int], int]]:
    """(token ids, first position) of each attention row of a scheduled chunk. A chunk with drafts
    is one decode row per token, each over the context up to itself: the verification of k drafts
    runs as k + 1 decodes sharing a block table, on the decode kernels."""
    seq, start = item.seq, item.seq.num_computed_tokens
    if not item.spec_token_ids:
        return [(seq.token_ids[start:start + item.num_new_tokens], start)]
    tokens = seq.token_ids[start:] + item.spec_token_ids
    return [([token], start + j) for j, token in enumerate(tokens)]


def _is_decode(item: ScheduledSeq) -> bool:
    return item.num_new_tokens - len(item.spec_token_ids) == 1


def _order(item: ScheduledSeq) -> tuple[bool, str]:
    lora = item.seq.lora
    return not _is_decode(item), "" if lora is None else lora.name + "\0" + lora.path


def flatten_step(scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]] | None,
                 block_size: int) -> FlatStep:
    """Flatten the step: decodes first, then prefill chunks, tokens concatenated, no padding. Within
    each, the rows of one LoRA adapter are kept together (base rows first): the CPU's adapter products
    then run over contiguous rows (kernels/lora.py), never gathering or scattering them."""
    batch = sorted(scheduled, key=_order)
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    sample_rows: list[int] = []
    sample_seqs: list[Sequence] = []
    drafts: list[list[int]] = []
    row_loras: list[tuple[LoRARequest | None, int]] = []
    pool_rows: list[int] = []
    pool_seqs: list[tuple[Sequence, int]] = []
    pool_every_row = False
    num_decodes = 0
    for item in batch:
        blocks = item.block_ids
        for ids, start in _rows(item):
            end = start + len(ids)
            input_ids.extend(ids)
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            starts.append(starts[-1] + len(ids))
            seq_lens.append(end)
            tables.append(blocks)
            row_loras.append((item.seq.lora, len(ids)))
            num_decodes += len(ids) == 1 and _is_decode(item)
            if item.spec_token_ids:
                sample_rows.append(starts[-1] - 1)
        if item.seq.pooling is not None:  # an embedding: its rows are pooled, nothing is sampled
            rows = _pool_rows(item, starts[-1])
            pool_rows += rows
            pool_every_row |= len(rows) > 1
            if rows:
                pool_seqs.append((item.seq, len(rows)))
        elif item.spec_token_ids:
            sample_seqs.append(item.seq)
            drafts.append(item.spec_token_ids)
        elif item.samples_next_token:
            # Forked siblings (parallel samples) draw their first token from the same row.
            for sampler_seq in (item.seq, *item.forks):
                sample_rows.append(starts[-1] - 1)
                sample_seqs.append(sampler_seq)
                drafts.append([])
    width = max((len(t) for t in tables), default=0)
    payload = input_ids  # extended in place: the ids are its first section
    payload += positions
    payload += slots
    payload += starts
    payload += seq_lens
    for t in tables:
        payload += t
        payload += [0] * (width - len(t))
    payload += sample_rows
    copies = block_copies or []
    for src, dst in copies:
        payload += (src, dst)
    payload += pool_rows
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    header = [starts[-1], len(seq_lens), width, len(sample_rows), len(copies),
              num_decodes, max(query_lens, default=0), max(seq_lens, default=0),
              max(seq_lens[:num_decodes], default=0), len(pool_rows), int(pool_every_row)]
    return FlatStep(header, payload, sample_seqs, drafts, row_loras, pool_seqs)


def _pool_rows(item: ScheduledSeq, end: int) -> list[int]:
    """The flat rows of a pooling chunk (ending before row `end`) whose hidden states its pool needs:
    all of them for the mean, the prompt's last one (in its last chunk only) for the last token."""
    assert item.seq.pooling is not None
    if item.seq.pooling.params.pooling == "mean":
        return list(range(end - item.num_new_tokens, end))
    return [end - 1] if item.samples_next_token else []


def payload_tensor(payload: list[int]) -> torch.Tensor:
    """The payload as a CPU int64 tensor (through `array`: 3x faster than `torch.tensor(list)`)."""
    return torch.frombuffer(array.array("q", payload), dtype=torch.long) if payload else \
        torch.empty(0, dtype=torch.long)


def section_sizes(header: list[int]) -> list[int]:
    """Lengths of the payload's sections, in order (see FlatStep)."""
    t, b, w, s, c = header[:5]
    return [t, t, t, b + 1, b, b * w, s, 2 * c, header[9]]


def unflatten_step(header: list[int], flat: torch.Tensor) -> StepInputs:
    """Tensors for the model from a flattened step (`flat`: the payload, int64, on the device)."""
    _, b, w, _, c, num_decodes, max_query_len, max_seq_len, max_decode_seq_len, _, pool_every_row = header
    ids, pos, slots, starts, lens, tables, rows, copies, pool_rows = flat.split(section_sizes(header))
    meta = AttentionMetadata(
        num_decodes=num_decodes,
        query_start_loc=starts.to(torch.int32),
        seq_lens=lens.to(torch.int32),
        slot_mapping=slots,
        block_tables=tables.view(b, w).to(torch.int32),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        max_decode_seq_len=max_decode_seq_len,
    )
    return StepInputs(ids, pos, meta, rows, copies.view(c, 2), pool_rows, bool(pool_every_row))
