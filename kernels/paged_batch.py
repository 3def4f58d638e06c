"""The description of a paged varlen batch that every `paged_attention` implementation reads."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class PagedBatch:
    """Which sequences a flat batch of queries belongs to and where each one's KV lives.

    Sequence i brings `q_len_i = cu_seqlens_q[i + 1] - cu_seqlens_q[i]` new tokens, rows
    `cu_seqlens_q[i]:cu_seqlens_q[i + 1]` of the queries. Query j of them sits at position
    `seq_lens[i] - q_len_i + j` and attends causally to keys `[0, position]`, read through
    `block_tables[i]`. Prefill, chunked prefill, prefix-cache hits and decode are all one such
    batch: a sequence's history is read from the cache, never passed in.

    Frozen, its tensors not: a CUDA graph is captured on a batch of static buffers whose
    contents change in place between replays, while the two host integers, which pick the
    Triton kernel's path, grid and split count, stay those of the capture.

    Attributes:
        block_tables: int32 `[num_seqs, max_blocks_per_seq]`, block ids of each sequence;
            entries past a sequence's last block are padding and never read.
        seq_lens: int32 or int64 `[num_seqs]`, KV length of each sequence including this
            step's tokens; a one-query row of length 0 (a decode graph's padding) attends to
            nothing and comes out as zeros.
        cu_seqlens_q: int32 or int64 `[num_seqs + 1]`, start offset of each sequence's queries;
            a sequence may have none (a mixed graph's padding).
        max_seqlen_q: at least every `q_len_i`; 1 makes a decode batch, one query per sequence.
        max_seqlen_k: at least every `seq_lens` entry.
    """

    block_tables: Tensor
    seq_lens: Tensor
    cu_seqlens_q: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
