"""Both attention backends (and so the references the torch one calls) against naive dense math.

The references define the Triton kernels, so they are checked here against attention written
out the slow way: per token and head, in float64, over K/V kept densely per sequence.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_testing import ATTN_TOL, DEVICES, DTYPES, ELEMENTWISE_TOL, query_start_loc, randn, rel_err
from streamer_kernels.rotary import rotary_embedding_ref

from streamer.attention import get_backend
from streamer.attention.backend import AttentionMetadata
from streamer.errors import ConfigError

TORCH_DEVICES = ["cpu", DEVICES[1]]


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`q` [n, H, D] are the last n of the L positions in `k`/`v` [L, KVH, D]; causal; float64."""
    n, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        pos = length - n + i
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            scores = [float(q[i, h].double() @ k[j, kvh].double()) * scale for j in range(pos + 1)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            out[i, h] = sum(w / total * v[j, kvh].double() for j, w in enumerate(weights))
    return out


def _run_backend(name: str, dtype: torch.dtype, device: str) -> None:
    """A mixed step: 2 decodes then 2 prefill chunks (one extending cached context, one fresh)."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_size, block_size = 8, 2, 80, 8
    seq_lens, query_lens = [21, 9, 30, 11], [1, 1, 12, 11]
    keys = [randn(n, kv_heads, head_size, dtype=dtype, device=device, gen=gen) for n in seq_lens]
    values = [randn(n, kv_heads, head_size, dtype=dtype, device=device, gen=gen) for n in seq_lens]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in blocks_per_seq:
        tables.append(order[:n] + [0] * (max(blocks_per_seq) - n))
        order = order[n:]
    shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache = torch.zeros(shape, dtype=dtype, device=device)
    value_cache = torch.zeros(shape, dtype=dtype, device=device)
    slots, new_k, new_v = [], [], []
    for b, (n, q_len) in enumerate(zip(seq_lens, query_lens)):
        for pos in range(n):
            blk, off = tables[b][pos // block_size], pos % block_size
            if pos < n - q_len:  # context cached by earlier steps
                key_cache[blk, off], value_cache[blk, off] = keys[b][pos], values[b][pos]
            else:  # this step's tokens: the backend writes them
                slots.append(blk * block_size + off)
                new_k.append(keys[b][pos])
                new_v.append(values[b][pos])
    meta = AttentionMetadata(
        num_decodes=2, query_start_loc=query_start_loc(query_lens, device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), max_decode_seq_len=max(seq_lens[:2]))
    query = randn(sum(query_lens), heads, head_size, dtype=dtype, device=device, gen=gen)
    backend = get_backend(name, torch.device(device))
    backend.write_kv(torch.stack(new_k), torch.stack(new_v), key_cache, value_cache, meta)
    scale = head_size ** -0.5
    out = backend.forward(query, key_cache, value_cache, meta, scale)
    starts = meta.query_start_loc.tolist()
    dense = torch.cat([_dense_attention(query[starts[b]:starts[b + 1]].cpu(), keys[b].cpu(), values[b].cpu(), scale)
                       for b in range(len(seq_lens))])
    assert rel_err(out.cpu(), dense) < ATTN_TOL[dtype]


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_backend_matches_dense_attention(dtype: torch.dtype, device: str) -> None:
    _run_backend("torch", dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_backend_matches_dense_attention(dtype: torch.dtype, device: str) -> None:
    _run_backend("triton", dtype, device)


def test_rotary_reference_is_a_rotation_of_each_half_pair() -> None:
    # Position p turns the pair (x[j], x[j + D/2]) by angle p * inv_freq[j]: a complex product.
    gen = torch.Generator().manual_seed(2)
    head_size, heads = 64, 3
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    positions = torch.tensor([3, 17, 40])
    angles = positions[:, None].double() * inv_freq[None, :]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    cache = torch.zeros(41, head_size).index_copy_(0, positions, cache)
    q = torch.randn(3, heads * head_size, generator=gen)
    k = torch.randn(3, heads * head_size, generator=gen)
    expected = []
    for x in (q, k):
        h = x.view(3, heads, head_size).double()
        z = torch.complex(h[..., :head_size // 2], h[..., head_size // 2:]) * torch.polar(
            torch.ones_like(angles), angles)[:, None, :]
        expected.append(torch.cat((z.real, z.imag), dim=-1).reshape(3, -1))
    rotary_embedding_ref(positions, q, k, cache, head_size)
    assert rel_err(q, expected[0]) < 1e-6 and rel_err(k, expected[1]) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_triton_backend_elementwise_methods_match_torch_backend(device: str) -> None:
    gen = torch.Generator().manual_seed(4)
    triton_be, torch_be = get_backend("triton", torch.device(device)), get_backend("torch", torch.device(device))
    dtype = torch.float16
    x, res = (randn(6, 96, dtype=dtype, device=device, gen=gen) for _ in range(2))
    w = randn(96, dtype=dtype, device=device, gen=gen)
    for got, ref in zip(triton_be.rms_norm(x, w, 1e-6, res), torch_be.rms_norm(x, w, 1e-6, res)):
        assert rel_err(got, ref) < ELEMENTWISE_TOL[dtype]
    assert rel_err(triton_be.rms_norm(x, w, 1e-6), torch_be.rms_norm(x, w, 1e-6)) < ELEMENTWISE_TOL[dtype]
    gate_up = randn(6, 2 * 72, dtype=dtype, device=device, gen=gen)
    assert rel_err(triton_be.silu_and_mul(gate_up), torch_be.silu_and_mul(gate_up)) < ELEMENTWISE_TOL[dtype]
    cache = randn(20, 64, dtype=torch.float32, device=device, gen=gen)
    positions = torch.tensor([1, 5, 19, 7, 2, 11], device=device)
    qk = randn(6, 6 * 64, dtype=dtype, device=device, gen=gen)
    qk_ref = qk.clone()
    triton_be.rotary(positions, qk[:, :256], qk[:, 256:], cache, 64)
    torch_be.rotary(positions, qk_ref[:, :256], qk_ref[:, 256:], cache, 64)
    assert rel_err(qk, qk_ref) < ELEMENTWISE_TOL[dtype]
    caches = [randn(4, 8, 2, 64, dtype=dtype, device=device, gen=gen) for _ in range(4)]
    caches_ref = [c.clone() for c in caches]
    mapping = torch.tensor([[2, 0], [1, 3]], device=device)
    triton_be.copy_blocks(caches[:2], caches[2:], mapping)
    torch_be.copy_blocks(caches_ref[:2], caches_ref[2:], mapping)
    assert all(torch.equal(a, b) for a, b in zip(caches, caches_ref))


def test_triton_backend_without_gpu_or_interpreter_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs a CUDA GPU.*TRITON_INTERPRET=1"):
        get_backend("triton", torch.device("cpu"))
