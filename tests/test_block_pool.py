"""BlockPool and its free queue: exact block ids, free order, eviction and error cases."""

import pytest

from pagedctl.engine.core.block_hash import hash_block_tokens, root_hash
from pagedctl.engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def h(i: int) -> bytes:
    return hash_block_tokens(root_hash(0), [i] * 4)


def test_initial_order_and_allocation():
    pool = BlockPool(6)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_ids(pool) == [3, 4, 5]
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 3
    assert pool.usage == 0.5
    pool.check_integrity()


def test_free_order_uncached_first_then_cached_lru():
    pool = BlockPool(6)
    b0, b1, b2 = pool.get_new_blocks(3)
    assert pool.cache_block(b0, h(0)) and pool.cache_block(b1, h(1))
    pool.free_blocks([b2, b1, b0])  # a sequence frees tail first
    # The uncached block goes to the head (reused first), cached ones to the tail in free order.
    assert free_ids(pool) == [2, 3, 4, 5, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [2, 3, 4, 5]
    assert pool.get_cached_block(h(1)) is b1
    # Reusing block 1 evicts its stale hash; block 0 stays findable.
    (reused,) = pool.get_new_blocks(1)
    assert reused is b1 and b1.block_hash is None
    assert pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(0)) is b0
    pool.check_integrity()


def test_touch_revives_free_cached_block_from_the_middle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i))
    pool.free_blocks(blocks)
    assert free_ids(pool) == [0, 1, 2, 3]
    pool.touch([blocks[2]])
    assert blocks[2].ref_cnt == 1
    assert free_ids(pool) == [0, 1, 3]
    pool.touch([blocks[2]])  # a second holder: no queue change
    assert blocks[2].ref_cnt == 2 and pool.num_free_blocks == 3
    pool.free_blocks([blocks[2]])
    assert free_ids(pool) == [0, 1, 3]  # still referenced once
    pool.free_blocks([blocks[2]])
    assert free_ids(pool) == [0, 1, 3, 2]
    pool.check_integrity()


def test_double_free_and_bad_queue_operations_raise():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])
    (b,) = pool.get_new_blocks(1)
    with pytest.raises(RuntimeError, match="cannot be freed"):
        pool.free_block_queue.append(b)  # a referenced block never enters the free queue
    with pytest.raises(RuntimeError, match="not in the free queue"):
        pool.free_block_queue.remove(b)
    with pytest.raises(RuntimeError, match="asked for 3 blocks"):
        pool.get_new_blocks(3)


def test_free_queue_popleft_and_appendleft():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.popleft() is blocks[0]
    q.appendleft(blocks[0])
    q.remove(blocks[1])
    q.append(blocks[1])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 2, 1]
    assert q.num_free_blocks == 3
    for _ in range(3):
        q.popleft()
    with pytest.raises(RuntimeError, match="no free KV block"):
        q.popleft()


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, h(9))
    assert not pool.cache_block(b, h(9))
    assert b.block_hash is None and pool.get_cached_block(h(9)) is a


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(1))
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h(1)) is None and a.block_hash is None


def test_check_integrity_detects_corruption():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    a.ref_cnt = 0  # leaked: neither free nor referenced
    with pytest.raises(AssertionError, match="free \\+ used"):
        pool.check_integrity()


class _EagerPool(BlockPool):
    """Every block made up front, the order the lazy pool must reproduce."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = {}


@pytest.mark.parametrize("seed", range(20))
def test_blocks_made_on_demand_come_out_in_the_eager_order(seed):
    import random

    rng = random.Random(seed)
    lazy, eager = BlockPool(64), _EagerPool(64)
    held: list[list[int]] = []
    for step in range(300):
        op = rng.random()
        if op < 0.45 and lazy.num_free_blocks:
            n = rng.randint(1, min(6, lazy.num_free_blocks))
            got = [b.block_id for b in lazy.get_new_blocks(n)]
            assert got == [b.block_id for b in eager.get_new_blocks(n)], step
            for i in got:
                if rng.random() < 0.5:  # a full block: cached under a hash of its own
                    key = h(1000 * seed + step * 10 + got.index(i))
                    assert lazy.cache_block(lazy.blocks[i], key)
                    assert eager.cache_block(eager.blocks[i], key)
            held.append(got)
        elif op < 0.85 and held:
            ids = held.pop(rng.randrange(len(held)))
            lazy.free_blocks([lazy.blocks[i] for i in reversed(ids)])
            eager.free_blocks([eager.blocks[i] for i in reversed(ids)])
        elif lazy.cached_block_hash_to_block:  # a prefix hit revives a free cached block
            key = rng.choice(sorted(lazy.cached_block_hash_to_block))
            block = lazy.get_cached_block(key)
            lazy.touch([block])
            eager.touch([eager.get_cached_block(key)])
            held.append([block.block_id])
        assert lazy.num_free_blocks == eager.num_free_blocks
    assert free_ids(lazy) == free_ids(eager)
    lazy.check_integrity()


def test_a_million_block_pool_makes_only_what_it_hands_out():
    pool = BlockPool(1_000_000)
    assert pool.num_free_blocks == 1_000_000 and pool.blocks == []
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2] and len(pool.blocks) == 3
    pool.free_blocks(blocks)
    assert [b.block_id for b in pool.get_new_blocks(4)] == [2, 1, 0, 3]
    assert pool.num_free_blocks == 1_000_000 - 4
