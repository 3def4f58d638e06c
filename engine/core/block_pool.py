"""The pool of KV blocks: reference counts, the free queue and the hash -> block map."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .block_hash import BlockHash


class KVCacheBlock:
    """One block of KV slots. `prev_free`/`next_free` belong to `FreeKVCacheBlockQueue` alone."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly-linked list threaded through the blocks themselves, between two sentinel nodes.

    Every operation is O(1) and allocates nothing; `remove` takes a block out of the middle, which a
    prefix hit on a free cached block needs. The head is reused first.
    """

    def __init__(
        self,
        blocks: Iterable[KVCacheBlock] = (),
        num_fresh: int = 0,
        make: Callable[[], KVCacheBlock] | None = None,
    ) -> None:
        """`blocks` in order, then `num_fresh` blocks not yet made, which `make` creates one at
        a time as they come to the head (a pool of a million blocks starts in microseconds)."""
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)
        # The blocks not yet made stand as one marker node: blocks freed to the head go before
        # them and blocks freed to the tail after them, exactly where they would be if made.
        self._fresh = KVCacheBlock(-2)
        self._num_fresh, self._make = num_fresh, make
        if num_fresh:
            assert make is not None, "fresh blocks need a maker"
            prev = self._tail.prev_free
            self._fresh.prev_free, self._fresh.next_free = prev, self._tail
            prev.next_free = self._tail.prev_free = self._fresh
            self.num_free_blocks += num_fresh

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._fresh:
            self._num_fresh -= 1
            self.num_free_blocks -= 1
            if not self._num_fresh:
                self._unlink_fresh()
            return self._make()
        if block is self._tail:
            raise RuntimeError("no free KV block left")
        self.remove(block)
        return block

    def _unlink_fresh(self) -> None:
        prev, nxt = self._fresh.prev_free, self._fresh.next_free
        prev.next_free, nxt.prev_free = nxt, prev
        self._fresh.prev_free = self._fresh.next_free = None

    def make_all(self) -> None:
        """Make the blocks not yet made, in their place in the queue (integrity checks and
        tests walk every block)."""
        if not self._num_fresh:
            return
        prev = self._fresh.prev_free
        self._unlink_fresh()
        n, self._num_fresh = self._num_fresh, 0
        self.num_free_blocks -= n
        for _ in range(n):
            block = self._make()
            self._link(block, prev, prev.next_free)
            prev = block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail: reused last."""
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put `block` at the head: reused first."""
        self._link(block, self._head, self._head.next_free)

    def _link(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free is not None or block.ref_cnt != 0:
            raise RuntimeError(
                f"block {block.block_id} cannot be freed: ref_cnt={block.ref_cnt}, "
                f"already free={block.prev_free is not None}"
            )
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Free blocks from head (reused next) to tail; for tests and integrity checks (the
        blocks not yet made are made first)."""
        self.make_all()
        out = []
        block = self._head.next_free
        while block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    """A fixed set of blocks with reference counts and a prefix-cache index.

    A block is free when its `ref_cnt` is 0; it then sits in the free queue. A free block keeps its
    hash (and stays findable by it) until it is handed out again, so a later request, or the same
    sequence recomputed after a preemption, can revive it. Free order: blocks without a hash are
    reused first; hashed ones least-recently-freed first.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Blocks are made when first handed out (ids in order), so `blocks[i]` exists for
        # every id a sequence has ever held; the free queue stands for the rest.
        self.blocks: list[KVCacheBlock] = []
        self.free_block_queue = FreeKVCacheBlockQueue(num_fresh=num_blocks, make=self._make)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def _make(self) -> KVCacheBlock:
        block = KVCacheBlock(len(self.blocks))
        self.blocks.append(block)
        return block

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence."""
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their stale hashes."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full block whose KV has been written. False when the hash already has a block.

        Two sequences that computed the same prefix in the same step hold equal blocks; the first
        one registered wins and the other stays unhashed (it is reused first once freed).
        """
        assert block.ref_cnt > 0 and block.block_hash is None, block
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block, reviving free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue in this order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def check_integrity(self) -> None:
        """Assert that the free queue, reference counts and the hash map agree."""
        free = self.free_block_queue.get_all_free_blocks()  # makes every block
        assert len(self.blocks) == self.num_blocks, "blocks made != the pool's size"
        assert len(free) == self.num_free_blocks, "free count drifted from the queue"
        assert len({b.block_id for b in free}) == len(free), "a block is twice in the free queue"
        assert all(b.ref_cnt == 0 for b in free), "a referenced block is in the free queue"
        used = [b for b in self.blocks if b.ref_cnt > 0]
        assert len(free) + len(used) == self.num_blocks, "free + used != total"
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref_cnt"
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"stale hash entry for block {block.block_id}"
