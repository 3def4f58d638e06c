"""Chained block hashes for the automatic prefix cache.

A block's hash covers its parent's hash, its own token ids and the extra keys (the cache salt,
on the first block only), so equal hashes mean equal whole prefixes, not just equal blocks.

The hash is BLAKE2b with a 128-bit digest. At 128 bits an accidental collision is out of reach (the
birthday bound is ~2**64 blocks), so a hit is not verified against the tokens. The chain's root is
derived from a seed, so hashes are reproducible across runs; a multi-tenant deployment that fears
crafted collisions should set a secret `cache_salt` per tenant.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

BlockHash = bytes

_DIGEST_SIZE = 16


def root_hash(seed: int) -> BlockHash:
    """The parent hash of every sequence's first block."""
    return blake2b(b"pagedctl-root:%d" % seed, digest_size=_DIGEST_SIZE).digest()


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: Sequence[int], extra_key: str | None = None
) -> BlockHash:
    """Hash one full block given its parent's hash."""
    h = blake2b(parent_hash, digest_size=_DIGEST_SIZE)
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(b"\x00salt:")
        h.update(extra_key.encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    cache_salt: str | None = None,
) -> None:
    """Append the hashes of the full blocks of `token_ids` not yet in `hashes` (in place)."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else root
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block, cache_salt if i == 0 else None))


def shared_block_prefix(
    a: Sequence[int], b: Sequence[int], num_blocks: int, block_size: int
) -> int:
    """How many of the first `num_blocks` full blocks two token lists have in common (token for
    token: list comparison runs in C, far cheaper than hashing the blocks again)."""
    n = num_blocks * block_size
    if a[:n] == b[:n]:
        return num_blocks
    lo, hi = 0, num_blocks  # the first `lo` blocks are equal, the first `hi` are not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * block_size : mid * block_size] == b[lo * block_size : mid * block_size]:
            lo = mid
        else:
            hi = mid
    return lo
