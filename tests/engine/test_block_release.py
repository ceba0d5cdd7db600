"""BlockManager.release_outside_window on its own: which blocks a sequence gives back as its
window moves on, and that forks, frees and prefix hits count the released blocks exactly once."""

from __future__ import annotations

from streamer.block_manager import BlockManager
from streamer.request import Sequence
from streamer.sampling_params import SamplingParams

BS = 4


def _running(bm: BlockManager, n_tokens: int, request_id: str = "r") -> Sequence:
    seq = Sequence(request_id=request_id, index=0, token_ids=list(range(10, 10 + n_tokens)),
                   num_prompt_tokens=n_tokens, params=SamplingParams(max_tokens=100))
    assert bm.allocate(seq, n_tokens)
    seq.num_computed_tokens = n_tokens
    bm.cache_full_blocks(seq)
    return seq


def test_releases_the_blocks_wholly_before_the_next_tokens_window() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    seq = _running(bm, 30)  # 8 blocks; the next token (position 30) with a window of 10 reads 21..30
    assert bm.release_outside_window(seq, 10) == 5  # positions 0..19: blocks 0-4
    assert bm.num_used_blocks == 3 and len(bm.block_table(seq)) == 8  # the table keeps its positions
    assert bm.release_outside_window(seq, 10) == 0  # nothing more until the window moves
    seq.token_ids += [98, 99, 100]
    assert bm.allocate(seq, 3)
    seq.num_computed_tokens = 32
    assert bm.release_outside_window(seq, 10) == 0  # the next token reads 23..32: 23 is in block 5
    seq.num_computed_tokens = 33
    assert bm.release_outside_window(seq, 10) == 1  # 24..33: block 5 (20..23) is out
    bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 16


def test_forks_share_only_the_held_blocks_and_free_each_once() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    parent = _running(bm, 24)
    bm.release_outside_window(parent, 6)  # (24 - 6 + 1) // 4 = 4 blocks
    child = Sequence(request_id="r", index=1, token_ids=list(parent.token_ids), num_prompt_tokens=24,
                     params=parent.params)
    bm.fork(parent, child)
    assert [bm.blocks[b].ref_count for b in bm.block_table(parent)[4:]] == [2, 2]
    bm.free(parent)
    assert bm.num_used_blocks == 2
    bm.free(child)
    assert bm.num_used_blocks == 0


def test_released_blocks_stay_cached_for_a_later_prompt() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    first = _running(bm, 20)
    bm.release_outside_window(first, 4)  # 4 of its 5 blocks
    later = Sequence(request_id="later", index=0, token_ids=list(first.token_ids[:12]) + [5, 6],
                     num_prompt_tokens=14, params=SamplingParams(max_tokens=4))
    hit = bm.find_cached_prefix(later)
    assert hit.block_ids == bm.block_table(first)[:3]  # revived from the free queue
