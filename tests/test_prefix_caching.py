"""KVCacheManager: allocation, prefix hits, eviction, revival, salts, fork and copy-on-write."""

from pagedctl.engine import CacheConfig, KVCacheManager
from tests.sched_utils import make_seq


def make_manager(num_blocks: int = 10, block_size: int = 4, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching)
    )


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(kv: KVCacheManager, ids: list[int]) -> list[int]:
    return [kv.pool.blocks[i].ref_cnt for i in ids]


def compute(kv: KVCacheManager, seq, hit=None, num_new: int | None = None) -> None:
    """Allocate, pretend the runner wrote the KV, advance and register full blocks."""
    hit = hit or []
    n = seq.num_tokens - seq.num_computed_tokens - len(hit) * kv.block_size
    n = n if num_new is None else num_new
    assert kv.allocate_slots(seq, n, hit) is not None
    seq.num_computed_tokens += len(hit) * kv.block_size + n
    kv.cache_blocks(seq)


def test_prefill_then_prefix_hit():
    kv = make_manager()
    a = make_seq(list(range(10)))
    assert kv.get_computed_blocks(a) == ([], 0)
    compute(kv, a)
    assert a.block_table == [0, 1, 2]
    # Only the two full blocks are hashed; the partial third is not.
    assert [kv.block_hash_of(i) is not None for i in a.block_table] == [True, True, False]

    b = make_seq([*range(8), 50, 51, 52])
    hit, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit] == [0, 1] and num_hit == 8
    assert kv.allocate_slots(b, 3, hit) == ()
    assert b.block_table == [0, 1, 3]
    assert ref_cnts(kv, [0, 1, 2, 3]) == [2, 2, 1, 1]
    kv.record_query(b, num_hit)
    assert (kv.stats.queried_tokens, kv.stats.hit_tokens) == (11, 8)


def test_hit_never_covers_the_whole_prompt():
    kv = make_manager()
    a = make_seq(list(range(12)))
    compute(kv, a)
    same = make_seq(list(range(8)))  # two full cached blocks: only the first may be hit
    hit, num_hit = kv.get_computed_blocks(same)
    assert [blk.block_id for blk in hit] == [0] and num_hit == 4
    longer = make_seq(list(range(9)))
    assert kv.get_computed_blocks(longer)[1] == 8


def test_block_not_hittable_before_its_kv_is_written():
    kv = make_manager()
    a = make_seq(list(range(8)) + [99])
    assert kv.allocate_slots(a, a.num_tokens) is not None  # scheduled, KV not yet written
    b = make_seq(list(range(8)) + [98])
    assert kv.get_computed_blocks(b) == ([], 0)
    a.num_computed_tokens = a.num_tokens
    kv.cache_blocks(a)  # after the step
    assert kv.get_computed_blocks(b)[1] == 8


def test_free_is_tail_first_and_cached_blocks_are_revived():
    kv = make_manager(num_blocks=6)
    a = make_seq(list(range(10)))
    compute(kv, a)
    kv.free(a)
    # Uncached tail block to the head; cached blocks appended tail first (so a prefix's tail is
    # evicted before its head).
    assert free_ids(kv) == [2, 3, 4, 5, 1, 0]
    b = make_seq(list(range(9)))
    hit, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit] == [0, 1] and num_hit == 8
    assert kv.allocate_slots(b, 1, hit) == ()
    assert b.block_table == [0, 1, 2]
    assert free_ids(kv) == [3, 4, 5]


def test_eviction_reuses_uncached_first_then_lru_and_drops_stale_hashes():
    kv = make_manager(num_blocks=4)
    a = make_seq(list(range(8)) + [1])
    compute(kv, a)  # blocks 0, 1 cached; 2 partial
    kv.free(a)
    assert free_ids(kv) == [2, 3, 1, 0]
    c = make_seq(list(range(200, 212)))  # needs 3 blocks: 2, 3, then the LRU cached block 1
    compute(kv, c)
    assert c.block_table == [2, 3, 1]
    assert free_ids(kv) == [0]
    # Block 1 lost its old hash, so a's second block is gone but its first is still a hit.
    b = make_seq(list(range(8)) + [5])
    hit, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit] == [0] and num_hit == 4


def test_admission_counts_revived_blocks_as_consumed():
    kv = make_manager(num_blocks=5)
    a = make_seq(list(range(8)) + [1])
    compute(kv, a)  # blocks 0, 1 cached, 2 partial
    kv.free(a)
    filler = make_seq(list(range(300, 308)))
    compute(kv, filler)  # takes blocks 2 and 3 (uncached first)
    assert filler.block_table == [2, 3] and free_ids(kv) == [4, 1, 0]
    b = make_seq(list(range(8)) + list(range(400, 410)))  # hits 0, 1, then needs 3 new blocks
    hit, _ = kv.get_computed_blocks(b)
    assert len(hit) == 2
    # 3 free blocks, but reviving 0 and 1 consumes two of them: 3 new + 2 revived > 3 free.
    assert kv.allocate_slots(b, 10, hit) is None
    assert b.block_table == [] and ref_cnts(kv, [0, 1]) == [0, 0]
    assert kv.allocate_slots(b, 4, hit) == ()  # 1 new + 2 revived fits
    assert b.block_table == [0, 1, 4]


def test_cache_salt_isolates_sequences():
    kv = make_manager()
    a = make_seq(list(range(9)), cache_salt="tenant-a")
    compute(kv, a)
    assert kv.get_computed_blocks(make_seq(list(range(9)), cache_salt="tenant-b"))[1] == 0
    assert kv.get_computed_blocks(make_seq(list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_seq(list(range(9)), cache_salt="tenant-a"))[1] == 8


def test_prefix_caching_disabled_never_hits():
    kv = make_manager(caching=False)
    a = make_seq(list(range(9)))
    compute(kv, a)
    assert kv.pool.cached_block_hash_to_block == {}
    assert kv.get_computed_blocks(make_seq(list(range(9)))) == ([], 0)


def test_fork_shares_blocks_and_copies_on_write():
    kv = make_manager()
    parent = make_seq(list(range(6)))
    compute(kv, parent)
    assert parent.block_table == [0, 1]
    child = parent.fork(sample_index=1)
    kv.fork(parent, child)
    assert child.block_table == [0, 1] and ref_cnts(kv, [0, 1]) == [2, 2]
    # Each appends a token; the child's write into the shared partial block 1 copies it first.
    child.token_ids.append(7)
    assert kv.allocate_slots(child, 1) == ((1, 2),)
    assert child.block_table == [0, 2] and ref_cnts(kv, [0, 1, 2]) == [2, 1, 1]
    parent.token_ids.append(8)
    assert kv.allocate_slots(parent, 1) == ()  # block 1 is the parent's alone now
    assert parent.block_table == [0, 1]
    assert kv.stats.cow_copies == 1
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 10
    kv.pool.check_integrity()


def test_fork_at_block_boundary_needs_no_copy():
    kv = make_manager()
    parent = make_seq(list(range(8)))
    compute(kv, parent)
    child = parent.fork(sample_index=1)
    kv.fork(parent, child)
    child.token_ids.append(7)
    assert kv.allocate_slots(child, 1) == ()
    assert child.block_table == [0, 1, 2] and ref_cnts(kv, [0, 1, 2]) == [2, 2, 1]


def test_allocation_refused_when_pool_is_full_changes_nothing():
    kv = make_manager(num_blocks=3)
    a = make_seq(list(range(9)))
    compute(kv, a)
    a.token_ids.extend([1, 2, 3, 4])
    assert kv.allocate_slots(a, 4) is None  # needs a 4th block
    assert a.block_table == [0, 1, 2] and kv.num_free_blocks == 0


def test_reserved_tokens_are_checked_but_not_allocated():
    kv = make_manager(num_blocks=4)
    a = make_seq(list(range(16)))
    assert kv.allocate_slots(a, 4, num_reserved_tokens=13) is None  # 17 tokens need 5 blocks
    assert kv.allocate_slots(a, 4, num_reserved_tokens=12) == ()
    assert a.block_table == [0] and kv.num_free_blocks == 3


def test_peak_usage_is_tracked():
    kv = make_manager(num_blocks=8)
    a, b = make_seq(list(range(12))), make_seq(list(range(50, 62)))
    compute(kv, a)
    compute(kv, b)
    kv.free(a)
    kv.free(b)
    assert kv.stats.peak_used_blocks == 6 and kv.num_free_blocks == 8


def test_a_new_chain_starts_from_a_recent_sequence_with_the_same_first_block():
    """Hash chains are taken over from the last sequence hashed with the same first block, as far
    as the tokens agree, then extended: always the hashes the tokens give from scratch."""
    from pagedctl.engine.core.block_hash import extend_block_hashes

    kv = make_manager(num_blocks=64, block_size=4)
    doc = list(range(100, 140))  # a shared prefix of 10 blocks
    first = make_seq([*doc, 1, 2, 3, 4, 5])
    kv.get_computed_blocks(first)
    cases = [
        [*doc, 9, 9, 9, 9, 9],  # the whole prefix shared
        [*doc[:22], 7, *doc[23:], 1],  # differs inside block 5: blocks 0-4 reused
        [*doc[:4], 8],  # one full block: nothing to take over
        [*doc[:3]],  # no full block
        [0, *doc],  # another first block: no donor
    ]
    for tokens in cases:
        seq = make_seq(tokens)
        kv.get_computed_blocks(seq)
        want: list[bytes] = []
        extend_block_hashes(want, tokens, 4, kv._root, None)
        assert seq.block_hashes == want, tokens
    salted = make_seq([*doc, 1], cache_salt="tenant-b")
    kv.get_computed_blocks(salted)
    assert salted.block_hashes[0] != first.block_hashes[0]
    assert not set(salted.block_hashes) & set(first.block_hashes)


def test_shared_block_prefix_counts_equal_leading_blocks():
    from pagedctl.engine.core.block_hash import shared_block_prefix

    a = list(range(40))
    for cut in range(41):
        b = [*a[:cut], -1, *a[cut + 1 :]][:40]
        want = min(cut // 4, 10)
        assert shared_block_prefix(a, b, 10, 4) == want, cut
    assert shared_block_prefix(a, a[:12], 3, 4) == 3
    assert shared_block_prefix(a, a, 0, 4) == 0
