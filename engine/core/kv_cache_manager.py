"""Block tables, reference counts and the prefix cache: the one owner of who holds which block.

The valid KV ranges of a sequence `seq`, with `bs = block_size`:
- tokens `[0, num_computed_tokens)` have their KV written, in
  `block_table[:ceil(num_computed_tokens / bs)]`;
- full blocks among them are hashed (and findable by later requests) once the step that wrote them
  is over: `cache_blocks` runs after the step, never at allocation time;
- `allocate_slots` extends the table to cover the tokens scheduled this step; the runner
  writes their KV; only then does the scheduler advance `num_computed_tokens`.

With a sliding window (`CacheConfig.sliding_window`, every layer attending to the last W
positions only), a block whose keys no later query of its sequence sees is given back after the
step (`drop_out_of_window`): the first `seq.num_dropped_blocks` entries of a table are no longer
held. They keep their (stale) block ids, which the attention kernels never read; a dropped block
keeps its hash, so the prefix cache serves it until it is evicted. A long sequence then holds
the window's blocks and one more, not its whole history.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .block_hash import (
    BlockHash,
    extend_block_hashes,
    hash_block_tokens,
    root_hash,
    shared_block_prefix,
)
from .block_pool import BlockPool, KVCacheBlock
from .config import CacheConfig
from .sequence import Sequence
from .swap import HostBlockPool
from .units import cdiv

CopyOp = tuple[int, int]  # (source block id, destination block id)
RECENT_CHAINS = 16  # sequences, by first block, whose hash chains new sequences may start from
NO_COPIES: tuple[CopyOp, ...] = ()


@dataclass
class PrefixCacheStats:
    """Prefix-cache and pool counters, summed since the manager was built."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    queries: int = 0
    hits: int = 0
    peak_used_blocks: int = 0
    cow_copies: int = 0
    dropped_blocks: int = 0  # given back out of a sliding window

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    """Hands KV blocks to sequences, shares them by reference count and finds cached prefixes."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config  # the pool's shape: its one owner (the runner reads the same)
        self.block_size = config.block_size  # read per sequence per step; the config is frozen
        self.enable_prefix_caching = config.enable_prefix_caching
        self.sliding_window = config.sliding_window
        self.pool = BlockPool(config.num_blocks)
        self.stats = PrefixCacheStats()
        self._root = root_hash(config.hash_seed)
        self._num_cached_blocks: dict[int, int] = {}  # seq_id -> leading blocks already hashed
        self._recent: OrderedDict[BlockHash, Sequence] = OrderedDict()  # first block hash -> seq
        # Swapped-out sequences hold host blocks instead: a table is on one side, never both.
        self.host = HostBlockPool(config.num_host_blocks) if config.num_host_blocks else None
        self._host_tables: dict[int, list[int]] = {}  # seq_id -> host block ids

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks that prefixes `seq`, and the tokens they hold.

        The hit never covers the whole sequence: at least one token is left to compute, so the step
        that admits it produces logits. A sequence that asks for its prompt's logprobs takes no
        hit (its blocks are cached for others all the same).
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens:
            return [], 0
        if seq.sampling_params.prompt_logprobs is not None:
            return [], 0  # its prompt's logprobs need every position computed (as vLLM)
        self._update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_reserved_tokens: int = 0,
        num_reserved_blocks: int = 0,
    ) -> tuple[CopyOp, ...] | None:
        """Give `seq` the slots for `num_new_tokens` more tokens; None when the pool cannot.

        Args:
            seq: the sequence; its `num_computed_tokens` does not yet count `new_computed_blocks`.
            num_new_tokens: tokens to be computed in this step.
            new_computed_blocks: prefix-cache hit from `get_computed_blocks`, adopted on success.
            num_reserved_tokens: tokens beyond these that must also fit now, without being allocated
                (admission of a resumed sequence checks its whole remaining prefill this way).
            num_reserved_blocks: blocks the sequence's beam group will hold in all once resumed,
                which the pool must have room for now in the same way.

        Returns:
            The copy-on-write block copies the runner must do before writing, or None if the free
            blocks cannot cover the new blocks, the revived free cached blocks and any copy.
        """
        computed = new_computed_blocks or []
        table = seq.block_table
        num_hit_tokens = len(computed) * self.block_size
        num_tokens = seq.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(table) - len(computed)
        cow = self._needs_copy(seq)
        if num_new_blocks <= 0 and not cow and not num_reserved_tokens and not num_reserved_blocks:
            return NO_COPIES  # decode fast path: the last block has room and is ours alone
        held = len(table) + len(computed)
        reserved = max(cdiv(num_tokens + num_reserved_tokens, self.block_size), num_reserved_blocks)
        num_revived = sum(1 for b in computed if b.ref_cnt == 0)
        needed = max(num_new_blocks, reserved - held, 0) + cow + num_revived
        if needed > self.pool.num_free_blocks:
            return None
        if computed:
            self._adopt_hit(seq, computed)
        copies = self._copy_on_write(seq) if cow else NO_COPIES
        if num_new_blocks > 0:
            table.extend(b.block_id for b in self.pool.get_new_blocks(num_new_blocks))
        self._note_peak()
        return copies

    def _note_peak(self) -> None:
        used = self.pool.num_used_blocks
        if used > self.stats.peak_used_blocks:
            self.stats.peak_used_blocks = used

    def _adopt_hit(self, seq: Sequence, computed: list[KVCacheBlock]) -> None:
        assert not seq.block_table, "a prefix hit is only taken by a sequence without blocks"
        self.pool.touch(computed)
        seq.block_table.extend(b.block_id for b in computed)
        self._num_cached_blocks[seq.seq_id] = len(computed)

    def record_query(self, seq: Sequence, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup at admission (not at each retry of a blocked admission)."""
        if self.enable_prefix_caching:
            self.stats.queries += 1
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hits += num_hit_tokens > 0
            self.stats.hit_tokens += num_hit_tokens

    def _needs_copy(self, seq: Sequence) -> bool:
        """Is the next write going into a partly filled block that another sequence also holds?"""
        if seq.num_computed_tokens % self.block_size == 0 or not seq.block_table:
            return False
        idx = seq.num_computed_tokens // self.block_size
        return self.pool.blocks[seq.block_table[idx]].ref_cnt > 1

    def _copy_on_write(self, seq: Sequence) -> tuple[CopyOp, ...]:
        idx = seq.num_computed_tokens // self.block_size
        old = self.pool.blocks[seq.block_table[idx]]
        (new,) = self.pool.get_new_blocks(1)
        self.pool.free_blocks([old])
        seq.block_table[idx] = new.block_id
        self.stats.cow_copies += 1
        return ((old.block_id, new.block_id),)

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks that became full in the step that just ran."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = max(self._num_cached_blocks.get(seq.seq_id, 0), seq.num_dropped_blocks)
        if num_full <= start:
            return
        self._update_hashes(seq)
        blocks = self.pool.blocks
        for i in range(start, num_full):
            block = blocks[seq.block_table[i]]
            if block.block_hash is None:
                self.pool.cache_block(block, seq.block_hashes[i])
        self._num_cached_blocks[seq.seq_id] = num_full

    def _update_hashes(self, seq: Sequence) -> None:
        hashes = seq.block_hashes
        if not hashes:
            self._start_chain(seq)
        extend_block_hashes(hashes, seq.token_ids, self.block_size, self._root, seq.cache_salt)
        if len(hashes) > 1:
            self._recent[hashes[0]] = seq
            self._recent.move_to_end(hashes[0])
            if len(self._recent) > RECENT_CHAINS:
                self._recent.popitem(last=False)

    def _start_chain(self, seq: Sequence) -> None:
        """Begin `seq`'s hashes with those of the last sequence hashed that has the same first
        block, as far as their tokens agree. A job's requests often share a long prefix (a system
        prompt, a document); hashing it again costs the host ~1 us a block (a round of four
        prefix hits after 16K cached tokens took 29 ms on the H200 against a 3.6 ms step; 15 ms
        with this), comparing the tokens a few percent of that. The
        first block's hash covers the cache salt, so sequences of other salts never match."""
        bs = self.block_size
        tokens = seq.token_ids
        if len(tokens) < 2 * bs:
            return
        first = hash_block_tokens(self._root, tokens[:bs], seq.cache_salt)
        donor = self._recent.get(first)
        if donor is None:
            seq.block_hashes.append(first)
            return
        limit = min(len(donor.block_hashes), len(tokens) // bs)
        shared = shared_block_prefix(tokens, donor.token_ids, limit, bs)
        seq.block_hashes.extend(donor.block_hashes[: max(shared, 1)])

    def drop_out_of_window(self, seq: Sequence) -> None:
        """Give back the blocks of `seq` that lie wholly before the window of its next query (at
        position `num_computed_tokens`, seeing keys from `num_computed_tokens - W + 1` on); run
        after the step, once `cache_blocks` has hashed them."""
        if self.sliding_window is None:
            return
        first_seen = seq.num_computed_tokens - self.sliding_window + 1
        drop = min(max(first_seen, 0) // self.block_size, len(seq.block_table))
        done = seq.num_dropped_blocks
        if drop > done:
            blocks = self.pool.blocks
            self.pool.free_blocks(blocks[i] for i in reversed(seq.block_table[done:drop]))
            seq.num_dropped_blocks = drop
            self.stats.dropped_blocks += drop - done

    @staticmethod
    def held_blocks(seq: Sequence) -> list[int]:
        """The block ids `seq` holds: its table less the entries dropped out of the window."""
        return seq.block_table[seq.num_dropped_blocks :]

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`, tail first, so a prefix's last blocks are evicted first
        (its host blocks, if it is swapped out)."""
        blocks = self.pool.blocks
        self.pool.free_blocks(blocks[i] for i in reversed(self.held_blocks(seq)))
        seq.block_table = []
        seq.num_dropped_blocks = 0
        self._num_cached_blocks.pop(seq.seq_id, None)
        host = self._host_tables.pop(seq.seq_id, None)
        if host:
            self.host.free(host)

    # ------------------------------------------------------------------ swapping

    def swap_out(self, unit: list[Sequence]) -> list[CopyOp] | None:
        """Move the blocks of `unit` (a victim's sequences) to the host pool, all or nothing;
        the (device block, host block) copies to make before any device block is written
        again, or None when the host pool cannot take them all.

        A block the unit's sequences share is copied once and shared on the host; one that a
        sequence outside the unit also holds is copied and stays on the device for it. The
        freed device blocks keep their hashes, so the prefix cache serves their data for as
        long as it lasts there, never from the host.
        """
        distinct = list(dict.fromkeys(b for seq in unit for b in self.held_blocks(seq)))
        if self.host is None or len(distinct) > self.host.num_free_blocks:
            return None
        to_host = dict(zip(distinct, self.host.allocate(len(distinct)), strict=True))
        seen: set[int] = set()
        for seq in unit:
            table = [to_host[b] for b in self.held_blocks(seq)]
            for h in table:
                if h in seen:
                    self.host.touch(h)
                seen.add(h)
            dropped = seq.num_dropped_blocks
            self.free(seq)
            seq.num_dropped_blocks = dropped  # its table comes back with the same positions
            self._host_tables[seq.seq_id] = table
        return list(to_host.items())

    def blocks_to_swap_in(self, unit: list[Sequence], num_new_tokens: int) -> int:
        """Device blocks `unit` needs to come back and compute `num_new_tokens` more each: its
        distinct host blocks, the blocks its new tokens open and one copy-on-write per beam."""
        tables = [self._host_tables[seq.seq_id] for seq in unit]
        grow = sum(
            max(
                cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
                - len(t)
                - seq.num_dropped_blocks,
                0,
            )
            for seq, t in zip(unit, tables, strict=True)
        )
        distinct = len({h for t in tables for h in t})
        return distinct + grow + (len(unit) - 1)

    def swap_in(self, unit: list[Sequence]) -> list[CopyOp]:
        """Bring `unit` back from the host (the caller checked `blocks_to_swap_in`); the (host
        block, device block) copies to make before the step's forward pass."""
        tables = [self._host_tables.pop(seq.seq_id) for seq in unit]
        distinct = list(dict.fromkeys(h for t in tables for h in t))
        fresh = self.pool.get_new_blocks(len(distinct))
        to_dev = {h: b.block_id for h, b in zip(distinct, fresh, strict=True)}
        seen: set[int] = set()
        blocks = self.pool.blocks
        for seq, table in zip(unit, tables, strict=True):
            held = [to_dev[h] for h in table]
            # dropped entries are never read: any valid block id stands in for them
            seq.block_table = [held[0] if held else 0] * seq.num_dropped_blocks + held
            for b in held:
                if b in seen:
                    self.pool.touch([blocks[b]])
                seen.add(b)
            self.host.free(table)
            self._num_cached_blocks[seq.seq_id] = seq.num_dropped_blocks
            self.cache_blocks(seq)  # full blocks findable again (unless another holds the hash)
        self._note_peak()
        return list(to_dev.items())

    def host_table(self, seq: Sequence) -> list[int]:
        return self._host_tables.get(seq.seq_id, [])

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks of `seq` past its first `num_tokens` tokens (slots reserved
        ahead and never written: unhashed, held by this sequence alone)."""
        table = seq.block_table
        keep = cdiv(num_tokens, self.block_size)
        if len(table) > keep:
            blocks = self.pool.blocks
            self.pool.free_blocks(blocks[i] for i in reversed(table[keep:]))
            del table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share all of `parent`'s blocks; the first write to a shared partial block
        copies it (see `allocate_slots`)."""
        assert not child.block_table
        blocks = self.pool.blocks
        self.pool.touch(blocks[i] for i in self.held_blocks(parent))
        child.block_table = list(parent.block_table)
        child.num_dropped_blocks = parent.num_dropped_blocks
        child.block_hashes = list(parent.block_hashes)
        self._num_cached_blocks[child.seq_id] = self._num_cached_blocks.get(parent.seq_id, 0)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def block_hash_of(self, block_id: int) -> BlockHash | None:
        return self.pool.blocks[block_id].block_hash

    def check_integrity(self, seqs: list[Sequence], lookahead: int = 0) -> None:
        """Assert the pool's invariants (docs/design.md) over the pool and the given live sequences:
        each sequence holds the blocks its computed tokens need, and every block's ref count is
        the number of tables that hold it.

        `lookahead`: tokens a multi-step decode window has reserved ahead of the computed ones.
        """
        self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        bs = self.block_size
        for seq in seqs:
            held, computed = len(seq.block_table), seq.num_computed_tokens
            assert cdiv(computed, bs) <= held <= cdiv(computed + lookahead, bs), seq
            for block_id in self.held_blocks(seq):
                holders[block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
        if self.host is not None:
            self.host.check_integrity(list(self._host_tables.values()))
        live = {seq.seq_id for seq in seqs}
        assert not live & self._host_tables.keys(), "a running sequence holds host blocks"
