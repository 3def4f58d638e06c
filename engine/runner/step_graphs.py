"""CUDA graphs of whole model steps, one per batch bucket, with the static inputs they read.

Launched one by one, the ~250 kernels of a step cost ~10 ms of host time (Triton's launcher); a
graph replay costs microseconds. Two kinds:

- decode graphs (one new token per sequence) per batch size 1, 2, 4, 8, 16, 32, ... up to
  `max_batch`; padding rows write nowhere (slot -1) and attend to nothing (length 0); the
  attention split count of each is fixed by `max_seqlen_k = max_model_len`;
- mixed graphs (prefill chunks, with or without decodes) per token count 256, 512, 1K, 1.5K, 2K,
  ... up to the step's token budget, with room for as many sequences as a step of that many
  tokens can hold (one token each at least, `max_seqs` at most: the attention grid of a small
  bucket is not padded to the largest batch); padding tokens write nowhere and padding sequences
  have no query tokens;
- few-sequence graphs, the mixed graphs of up to `FEW_MAX_TOKENS` tokens again, with room for
  `FEW_SEQS` sequences and attention split `FEW_SPLITS` ways along each query block's history.
  A step of a few sequences with long histories (a prefix-cache hit: a few new tokens after
  thousands of cached ones; the last chunk of a long prompt) would otherwise leave one program
  per query block and KV head walking the whole history while the other SMs idle.

The graphs of a kind read their inputs from one flat buffer, each from its own leading slice (so
one copy fills it), and their block tables from one buffer as wide as `max_model_len`. Every
tensor a graph reads is held here for the graphs' lifetime: a graph holds addresses, not
references. `emulate=True` builds the same buffers and replays by calling the model eagerly, so
CPU tests cover the padding and the static-buffer bookkeeping.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ...kernels import PagedBatch
from ..models.attention import AttentionMetadata, KVCache
from .startup import StartupClock

logger = logging.getLogger("pagedctl.engine")

MAX_GRAPH_BATCH = 512  # the largest decode graph; larger decode steps take a mixed graph
FEW_SEQS = 4  # sequences of a few-sequence graph
FEW_MAX_TOKENS = 512  # the largest few-sequence graph
FEW_SPLITS = 16  # attention programs per query block and KV head in a few-sequence graph
GraphKey = tuple[str, int]  # ("decode", sequences), ("mixed", tokens) or ("few", tokens)


def graph_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: 1, 2, 4, 8, then every 16 up to `max_batch`."""
    small = [b for b in (1, 2, 4, 8) if b <= max_batch]
    return small + list(range(16, max_batch + 1, 16)) + ([max_batch] if max_batch % 16 else [])


def token_buckets(max_tokens: int, smallest: int = 256) -> list[int]:
    """Token counts that get a mixed-step graph: 256, 512, 1024, 1536, 2048, 3072, 4096, ...
    (powers of two and the midpoints above 1K), ending with `max_tokens` itself."""
    sizes = sorted({2**k for k in range(8, 32)} | {3 * 2**k for k in range(9, 32)})
    return [b for b in sizes if smallest <= b < max_tokens] + [max(max_tokens, 1)]


class _EmulatedGraph:
    """Stands in for a CUDA graph on the CPU: replays by calling the model on the same static
    buffers and writing into the same output tensor."""

    def __init__(self, model: torch.nn.Module, args: tuple, out: Tensor) -> None:
        self.model, self.args, self.out = model, args, out

    def replay(self) -> None:
        self.args[-1].plan_cache.clear()  # the static inputs changed in place since last time
        self.out.copy_(self.model(*self.args))


class StepGraph(NamedTuple):
    graph: torch.cuda.CUDAGraph | _EmulatedGraph
    inputs: Tensor  # the slice of the flat input buffer this graph reads (one copy fills it)
    ids: Tensor  # views of `inputs`
    positions: Tensor
    rows: Tensor  # each sequence's row in the runner's persistent block-table array
    tables: Tensor  # where the step's block tables go before a replay
    hidden: Tensor  # the graph's output, one row per (padded) token


class StepGraphs:
    """The step graphs of one model, KV cache and set of limits, each captured on first use."""

    @torch.inference_mode()
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[KVCache],
        *,
        max_model_len: int,
        max_blocks: int,
        max_batch: int,
        max_tokens: int,
        max_seqs: int,
        emulate: bool = False,
        clock: StartupClock | None = None,
    ) -> None:
        """`clock`: where each capture's time (and its kernels' JIT) is counted, as start-up
        work done late."""
        dev = kv_caches[0][0].device
        self._clock = clock
        cuda = not emulate
        self.decode_sizes = graph_buckets(max_batch)
        self.mixed_sizes = token_buckets(max_tokens)
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len
        width, longest = self.decode_sizes[-1], self.mixed_sizes[-1]
        self.max_batch = width
        self._decode_flat = torch.zeros(5 * width, dtype=torch.int64, device=dev)
        self._decode_tables = torch.zeros((width, max_blocks), dtype=torch.int32, device=dev)
        self._decode_cu = torch.arange(width + 1, dtype=torch.int32, device=dev)
        flat = 3 * longest + 3 * max_seqs + 1
        self._mixed_flat = torch.zeros(flat, dtype=torch.int64, device=dev)
        self._mixed_tables = torch.zeros((max_seqs, max_blocks), dtype=torch.int32, device=dev)
        self._cuda, self._model, self._kv_caches = cuda, model, kv_caches
        self._pool = torch.cuda.graph_pool_handle() if cuda else None
        self.few_sizes = [t for t in self.mixed_sizes if t <= FEW_MAX_TOKENS]
        if max_seqs <= FEW_SEQS:
            self.few_sizes = []  # the mixed graphs are as small already
        self._graphs: dict[GraphKey, StepGraph] = {}
        self.pool_bytes = 0
        logger.info(
            "step graphs (%s, captured on first use): decode batches up to %d, mixed steps up "
            "to %d tokens x %d sequences, %d few-sequence sizes",
            "emulated" if emulate else "CUDA",
            width,
            longest,
            max_seqs,
            len(self.few_sizes),
        )

    @torch.inference_mode()
    def _capture(self, key: GraphKey) -> StepGraph:
        """Capture one bucket's graph (its kernels compiled by an eager run first).

        Captured when a step first needs it, before the step's inputs are copied in (the
        buffers are shared by every bucket, and the warm-up run zeroes them). The graphs
        share one memory pool: they replay one at a time, so each capture reuses what the
        ones before it freed.
        """
        with self._clock.phase("capture") if self._clock else nullcontext():
            return self._capture_timed(key)

    def _capture_timed(self, key: GraphKey) -> StepGraph:
        kind, size = key
        inputs, ids, positions, rows, tables, meta = (
            self._decode_inputs(size) if kind == "decode" else self._mixed_inputs(key)
        )
        args = (ids, positions, self._kv_caches, meta)
        hidden = self._model(*args)  # compiles the kernels of this shape outside a capture
        if self._cuda:
            dev = ids.device
            before = torch.cuda.memory_reserved(dev)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                hidden = self._model(*args)
            torch.cuda.synchronize(dev)
            self.pool_bytes += torch.cuda.memory_reserved(dev) - before
        else:
            graph = _EmulatedGraph(self._model, args, hidden)
        step = self._graphs[key] = StepGraph(graph, inputs, ids, positions, rows, tables, hidden)
        logger.debug("captured the %s graph of %d (%d so far)", kind, size, len(self._graphs))
        return step

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (benchmarks that must not capture inside a
        timed run; tests)."""
        keys = [("mixed", t) for t in reversed(self.mixed_sizes)]
        keys += [("few", t) for t in reversed(self.few_sizes)]
        keys += [("decode", b) for b in reversed(self.decode_sizes)]
        for key in keys:
            if key not in self._graphs:
                self._capture(key)

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def __getitem__(self, key: GraphKey) -> StepGraph:
        """The bucket's graph, captured now if this is its first use."""
        step = self._graphs.get(key)
        return step if step is not None else self._capture(key)

    def has_decode(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.max_batch

    def pick(self, num_seqs: int, num_tokens: int, decode: bool) -> GraphKey | None:
        """The smallest graph that fits a step, None to run it eagerly.

        A decode step larger than every decode bucket takes a mixed graph (its rows go through
        the prefill kernel path, still one replay instead of a few hundred launches).
        """
        if decode and num_seqs <= self.max_batch:
            return "decode", next(b for b in self.decode_sizes if b >= num_seqs)
        if num_seqs <= FEW_SEQS and self.few_sizes and num_tokens <= self.few_sizes[-1]:
            return "few", next(t for t in self.few_sizes if t >= num_tokens)
        if num_seqs <= self.max_seqs and num_tokens <= self.mixed_sizes[-1]:
            # every sequence of a step brings a token at least: the bucket has room for them
            return "mixed", next(t for t in self.mixed_sizes if t >= num_tokens)
        return None

    def seqs_of(self, key: GraphKey) -> int:
        """Sequences a graph has room for: a decode graph one per row, a few-sequence graph
        `FEW_SEQS`, a mixed graph of t tokens min(t, max_seqs) (each brings a token at least)."""
        kind, size = key
        if kind == "mixed":
            return min(size, self.max_seqs)
        return FEW_SEQS if kind == "few" else size

    def pack(self, key: GraphKey, arrays: tuple) -> np.ndarray:
        """A graph's whole input slice on the host, padding included, for one copy.

        `arrays`: the step's token ids, positions, slots, table rows, lengths, cu_seqlens.
        """
        ids, positions, slot_mapping, rows, seq_lens, cu = arrays
        kind, size = key
        t, n = len(ids), len(rows)
        if kind == "decode":
            pack = np.zeros((5, size), dtype=np.int64)
            pack[0, :t], pack[1, :t], pack[2, :t] = ids, positions, slot_mapping
            pack[3, :n], pack[4, :n] = seq_lens, rows
            pack[2, t:] = -1
            return pack.reshape(-1)
        seqs = self.seqs_of(key)
        pack = np.zeros(3 * size + 3 * seqs + 1, dtype=np.int64)
        tok = pack[: 3 * size].reshape(3, size)
        tok[0, :t], tok[1, :t], tok[2, :t] = ids, positions, slot_mapping
        tok[2, t:] = -1
        lens, cu_all, table_rows = np.split(pack[3 * size :], [seqs, 2 * seqs + 1])
        lens[:n], cu_all[: n + 1], cu_all[n + 1 :], table_rows[:n] = seq_lens, cu, t, rows
        return pack

    def clear(self) -> None:
        self._graphs.clear()

    def _decode_inputs(self, b: int) -> tuple:
        inputs = self._decode_flat[: 5 * b]
        view = inputs.view(5, b)
        # The flat buffer is shared by every bucket: a larger one's -1 slots would be this one's
        # token ids or positions in the warm-up run (a read before the rotary tables on the GPU).
        inputs.zero_()  # ids, positions, lengths: padding reads nothing
        view[2].fill_(-1)  # slots: padding writes nothing
        tables = self._decode_tables[:b]
        meta = AttentionMetadata(
            slot_mapping=view[2],
            batch=PagedBatch(
                block_tables=tables,
                seq_lens=view[3],
                cu_seqlens_q=self._decode_cu[: b + 1],
                max_seqlen_q=1,
                max_seqlen_k=self.max_model_len,  # fixes the split count of the bucket
            ),
        )
        return inputs, view[0], view[1], view[4], tables, meta

    def _mixed_inputs(self, key: GraphKey) -> tuple:
        kind, t = key
        seqs = self.seqs_of(key)
        inputs = self._mixed_flat[: 3 * t + 3 * seqs + 1]
        tables = self._mixed_tables[:seqs]
        tok = inputs[: 3 * t].view(3, t)
        lens, cu, rows = inputs[3 * t :].split([seqs, seqs + 1, seqs])
        inputs.zero_()  # shared by every key (see `_decode_inputs`): no other key's -1 slots
        tok[2].fill_(-1)
        meta = AttentionMetadata(
            slot_mapping=tok[2],
            batch=PagedBatch(
                block_tables=tables,
                seq_lens=lens,
                cu_seqlens_q=cu,
                max_seqlen_q=t,  # > 1: the prefill path, whose grid covers t tokens of `seqs` rows
                max_seqlen_k=self.max_model_len,
            ),
            num_splits=FEW_SPLITS if kind == "few" else None,
        )
        return inputs, tok[0], tok[1], rows, tables, meta
