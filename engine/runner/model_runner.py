"""Turns a `SchedulerOutput` into one flat varlen batch, runs the model and samples.

The runner reads sequences (tokens, `num_computed_tokens`, block tables) and never writes them; it
owns the KV cache tensors, the per-sequence random generators, a persistent copy of every running
sequence's block table (host and device), and on CUDA the step graphs (`engine.step_graphs`).

Input preparation is vectorised: each sequence keeps one row of the persistent block tables
(`engine.block_tables`), and only rows that changed since the last step travel to the device;
token ids, positions, slots and lengths are packed and sent in one copy (`engine.staging`). On
CUDA every step that fits a graph replays it; others run eagerly. The only host synchronisation
of a step is reading the sampled tokens.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ...kernels import PagedBatch, empty_kv_cache, graph_capturable
from ..core.config import CacheConfig, SchedulerConfig
from ..core.scheduler import SchedulerOutput
from ..core.sequence import Sequence
from ..core.units import cdiv
from ..models.attention import AttentionMetadata
from .block_tables import BlockTables
from .host_kv import HostKVCache
from .logits_processors import LogitsProcessors
from .prompt_logprobs import PromptLogprobs, prompt_logprobs
from .sampler import Sampler, SamplerOutput, make_generator
from .staging import Staging
from .startup import StartupClock
from .step_graphs import MAX_GRAPH_BATCH, StepGraphs

logger = logging.getLogger("pagedctl.engine")

GeneratorKey = tuple[str, int]  # (request_id, sample_index)


@dataclass
class StepResult:
    """Tokens drawn for each row (`[]` for a prefill chunk) and, where asked, their logprobs
    and each drawn token's position's most likely tokens (`top_logprobs[row][j]`: (token id,
    value) pairs, best first).

    A beam's row holds its group's number of best candidates instead (token ids, best first),
    with their float32 log-probabilities in `logprobs`.
    """

    sampled_token_ids: list[list[int]]
    logprobs: list[list[float]] | None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[PromptLogprobs | None] | None = None

    def place(self, part: StepResult, rows: list[int]) -> None:
        """Put `part`, the result of a step of this step's `rows`, into those rows."""
        n = len(self.sampled_token_ids)
        for name in ("sampled_token_ids", "logprobs", "top_logprobs", "prompt_logprobs"):
            values = getattr(part, name)
            if values is None:
                continue
            if getattr(self, name) is None:
                setattr(self, name, [None if name == "prompt_logprobs" else [] for _ in range(n)])
            mine = getattr(self, name)
            for i, row in enumerate(rows):
                mine[row] = values[i]


class Batch(NamedTuple):
    input_ids: Tensor  # int64 [num_tokens]
    positions: Tensor  # int64 [num_tokens]
    meta: AttentionMetadata | None  # None for a graph step: the graph holds its own
    logit_rows: list[int]  # rows of the SchedulerOutput that sample
    last_token_index: list[int]  # for each of those rows, its last token in the flat batch
    graph: tuple[str, int] | None  # the graph to replay ("decode", seqs) / ("mixed", tokens)
    table_rows: np.ndarray  # each sequence's row in the persistent block-table array
    starts: np.ndarray  # each sequence's first position in this step


class ModelRunner:
    """Runs one scheduler step on the model, reading and writing the paged KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        cache: CacheConfig,
        limits: SchedulerConfig,
        device: torch.device,
        kv_dtype: torch.dtype,
        seed: int | None = 0,
        cuda_graphs: bool | str = True,
        clock: StartupClock | None = None,
    ) -> None:
        """`cache` is the pool's shape (the scheduler's KV cache manager holds the same one):
        its blocks, their size and the host pool swapped-out blocks go to (allocated on first
        use; pinned on CUDA). `limits` bound a step's rows and tokens, which the block tables
        and the step graphs are sized for. `cuda_graphs="emulate"` runs the graph path without
        CUDA (static buffers, padded buckets, eager replays) so that tests on the CPU cover it.
        `clock` counts the step graphs' capture, done when each is first used."""
        self.model = model
        self.device = device
        max_model_len, max_num_seqs = limits.max_model_len, limits.max_num_seqs
        self.max_model_len = max_model_len
        # One tensor for every layer's K and V, so that a copy-on-write moves a block in all
        # layers in one operation; each layer sees `[num_blocks, block_size, Hkv, D]` views
        # (stored head-major inside a block where the Triton kernels run: see
        # `kernels.empty_kv_cache`). Left uninitialised: attention reads only slots its sequence
        # has written, and the memory is committed as it is first written (a 4 GiB CPU pool
        # costs nothing up front).
        self._kv = empty_kv_cache(
            model.num_layers, cache.num_blocks, cache.block_size, model.num_kv_heads,
            model.head_dim, kv_dtype, device,
        )  # fmt: skip
        self.kv_caches = [(layer[0], layer[1]) for layer in self._kv]
        self.sampler = Sampler(seed)
        self._generators: dict[GeneratorKey, torch.Generator] = {}
        self.staging = Staging(device)
        self.processors = LogitsProcessors(model.vocab_size, device, self.staging)
        # One block-table row per live sequence; room for a sequence of max_model_len tokens
        # plus the blocks reserved ahead of a fork.
        max_blocks = cdiv(max_model_len, cache.block_size) + 2
        self.tables = BlockTables(
            max_blocks=max_blocks,
            block_size=cache.block_size,
            device=device,
            staging=self.staging,
            num_rows=max(16, max_num_seqs),
        )
        self.host_kv = HostKVCache(self._kv, cache.num_host_blocks, self.staging)
        self.step_counts: Counter[str] = Counter()  # steps run as "decode" / "mixed" / "eager"
        self.graphs: StepGraphs | None = None
        if cuda_graphs is True and device.type == "cuda" and not graph_capturable("cuda"):
            logger.warning("CUDA graphs off: PAGEDCTL_KERNELS=reference ops cannot be captured")
            cuda_graphs = False
        if (cuda_graphs and device.type == "cuda") or cuda_graphs == "emulate":
            self.graphs = StepGraphs(
                model,
                self.kv_caches,
                max_model_len=max_model_len,
                max_blocks=max_blocks,
                max_batch=min(max_num_seqs, MAX_GRAPH_BATCH),
                max_tokens=limits.max_num_batched_tokens,
                max_seqs=max_num_seqs,
                emulate=cuda_graphs == "emulate",
                clock=clock,
            )
        self.sampler.warm_up(model.vocab_size, model.dtype, device)  # the logits' width, dtype

    @property
    def max_graph_batch(self) -> int:
        """The largest decode batch with a graph (0: no graphs)."""
        return self.graphs.max_batch if self.graphs else 0

    @property
    def graph_pool_bytes(self) -> int:
        return self.graphs.pool_bytes if self.graphs else 0

    def has_decode_graph(self, num_seqs: int) -> bool:
        return self.graphs is not None and self.graphs.has_decode(num_seqs)

    # ------------------------------------------------------------------ stepping

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Copy-on-write copies, one forward pass over every scheduled token, then sampling."""
        self.staging.begin_step()
        if out.copies:
            self._copy_blocks(out.copies)
        batch = self._prepare(out)
        if batch.graph is not None:
            step = self.graphs[batch.graph]
            step.graph.replay()
            hidden = step.hidden
            self.step_counts[batch.graph[0]] += 1
        else:
            self.step_counts["eager"] += 1
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        sampled: list[list[int]] = [[] for _ in out.seqs]
        prompt = prompt_logprobs(self.model, self.staging, out, hidden)
        logit_rows = batch.logit_rows
        if not logit_rows:
            return StepResult(sampled, None, None, prompt)
        seqs = [out.seqs[i] for i in logit_rows]
        counts = [s.num_samples_to_draw for s in seqs]
        last = batch.last_token_index
        if len(last) == sum(counts) and last == list(range(len(last))):
            rows_hidden = hidden[: len(last)]  # a decode step: every row samples once, in order
        else:
            idx = [t for t, k in zip(last, counts, strict=True) for _ in range(k)]
            rows_hidden = hidden.index_select(
                0, self.staging.to_device(np.array(idx, dtype=np.int64))
            )
        logits = self.model.compute_logits(rows_hidden)
        params, generators, row_seqs = [], [], []
        for seq, k in zip(seqs, counts, strict=True):
            for j in range(k):
                params.append(seq.sampling_params)
                generators.append(self._generator(seq, j if k > 1 else seq.sample_index))
                row_seqs.append(seq)
        beams = [j for j, seq in enumerate(seqs) if seq.beam is not None]
        if len(beams) == len(seqs):  # nothing to sample
            result = SamplerOutput([], None)
        else:
            shaped = self.processors.apply(logits, row_seqs)
            tokens = self.sampler.sample(shaped, params, generators)
            self.processors.count(tokens, row_seqs)
            result = self.sampler.result(logits, shaped, params, tokens)
        logprobs: list[list[float]] | None = (
            None if result.logprobs is None and not beams else [[] for _ in out.seqs]
        )
        top = None if result.top_logprobs is None else [[] for _ in out.seqs]
        pos = 0
        for row, k in zip(logit_rows, counts, strict=True):
            if result.token_ids:
                sampled[row] = result.token_ids[pos : pos + k]
            if result.logprobs is not None:
                logprobs[row] = result.logprobs[pos : pos + k]
            if top is not None:
                top[row] = result.top_logprobs[pos : pos + k]
            pos += k
        if beams:
            first = np.cumsum([0, *counts])  # each sequence's first row of `logits`
            rows = [(first[j], logit_rows[j], seqs[j].beam.num_candidates) for j in beams]
            self._beam_candidates(logits, rows, sampled, logprobs)
        return StepResult(sampled, logprobs, top, prompt)

    def _beam_candidates(self, logits: Tensor, rows: list, sampled: list, logprobs: list) -> None:
        """Each beam's best candidates by float32 log-softmax (as transformers scores them);
        `rows` holds (row of `logits`, row of the step, number of candidates)."""
        k = min(max(n for _, _, n in rows), logits.shape[-1])
        index = self.staging.to_device(np.array([r for r, _, _ in rows], dtype=np.int64))
        lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        values, ids = (t.tolist() for t in lp.topk(k, dim=-1))
        for i, (_, row, n) in enumerate(rows):
            sampled[row], logprobs[row] = ids[i][:n], values[i][:n]

    @torch.inference_mode()
    def execute_decode_steps(self, out: SchedulerOutput, k: int) -> Iterator[list[int]]:
        """`k` decode steps of the same sequences back to back; yields each step's tokens.

        The sequences' slots for all `k` tokens are already allocated
        (`DecodeWindow.open`). Each step after the first feeds the previous step's
        tokens to the graph on the device and moves positions, lengths and slots one on. All `k`
        steps are enqueued first; each step's tokens are then yielded as soon as they reach the
        host, so the caller's bookkeeping of step j overlaps the GPU's work on the steps after
        it, and nothing waits for a whole step's round trip. Rows that finish
        inside the window keep computing until its end; their extra tokens are dropped by the
        caller (and for unseeded sampling they draw from the shared generator meanwhile).
        """
        self.staging.begin_step()
        batch = self._prepare(out)
        assert batch.graph is not None and batch.graph[0] == "decode", batch.graph
        step = self.graphs[batch.graph]
        seqs, n = out.seqs, len(out.seqs)
        ids, positions, slots, lens = step.inputs.view(5, -1)[:4, :n]
        first, table_rows = batch.starts, batch.table_rows
        ahead = self.tables.slot_mapping(table_rows, first[None, :] + np.arange(1, k)[:, None])
        ahead_dev = self.staging.to_device(
            ahead
        )  # [k - 1, rows]: the slots of the steps after this
        params = [s.sampling_params for s in seqs]
        generators = [self._generator(s, s.sample_index) for s in seqs]
        cuda = self.device.type == "cuda"
        landed = torch.empty((k, n), dtype=torch.int64, pin_memory=cuda)
        events, tokens = [], None
        for j in range(k):  # everything is enqueued before the host waits for anything
            if j:
                ids.copy_(tokens)
                positions.add_(1)
                lens.add_(1)
                slots.copy_(ahead_dev[j - 1])
            step.graph.replay()
            logits = self.processors.apply(self.model.compute_logits(step.hidden[:n]), seqs, j)
            tokens = self.sampler.sample(logits, params, generators)
            self.processors.count(tokens, seqs, j)
            landed[j].copy_(tokens, non_blocking=cuda)
            if cuda:
                events.append(torch.cuda.Event())
                events[-1].record()
        self.step_counts["decode"] += k
        try:
            for j in range(k):  # the caller applies step j while the GPU runs the next ones
                if cuda:
                    events[j].synchronize()
                yield landed[j].tolist()
        finally:
            if cuda:
                events[-1].synchronize()  # no copy may still be writing `landed`

    def _prepare(self, out: SchedulerOutput) -> Batch:
        seqs, nums = out.seqs, out.num_new_tokens
        n = len(seqs)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        q_lens = np.asarray(nums, dtype=np.int64)
        slots = np.fromiter((self.tables.sync(s) for s in seqs), dtype=np.int64, count=n)
        self.tables.push()
        seq_lens = starts + q_lens
        decode = bool((q_lens == 1).all())
        if decode:
            ids = np.fromiter(
                (s.token_ids[c] for s, c in zip(seqs, starts.tolist(), strict=True)),
                dtype=np.int64,
                count=n,
            )
            positions = starts
            cu = np.arange(n + 1, dtype=np.int64)
        else:
            ids = np.fromiter(
                chain.from_iterable(
                    s.token_ids[c : c + k]
                    for s, c, k in zip(seqs, starts.tolist(), nums, strict=True)
                ),
                dtype=np.int64,
                count=int(q_lens.sum()),
            )
            cu = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(q_lens, out=cu[1:])
            row = np.repeat(np.arange(n), q_lens)
            positions = starts[row] + np.arange(len(ids)) - cu[:-1][row]
        sample_rows = seq_lens == np.fromiter((s.num_tokens for s in seqs), np.int64, n)
        logit_rows = np.flatnonzero(sample_rows).tolist()
        last_token_index = (cu[1:][sample_rows] - 1).tolist()
        token_rows = slots if decode else slots[np.repeat(np.arange(n), q_lens)]
        slot_mapping = self.tables.slot_mapping(token_rows, positions)
        key = self.graphs.pick(n, len(ids), decode) if self.graphs else None
        if key is not None:
            arrays = (ids, positions, slot_mapping, slots, seq_lens, cu)
            return self._prepare_graph(key, arrays, starts, logit_rows, last_token_index)
        t = len(ids)
        pack = np.concatenate([ids, positions, slot_mapping, slots, seq_lens, cu])
        packed = self.staging.to_device(pack)
        dev_ids, dev_pos, dev_slot = packed[:t], packed[t : 2 * t], packed[2 * t : 3 * t]
        dev_slots, rest = packed[3 * t : 3 * t + n], packed[3 * t + n :]
        meta = AttentionMetadata(
            slot_mapping=dev_slot,
            batch=PagedBatch(
                block_tables=self.tables.device_table.index_select(0, dev_slots),
                seq_lens=rest[:n],
                cu_seqlens_q=rest[n:],
                max_seqlen_q=int(q_lens.max()),
                max_seqlen_k=int(seq_lens.max()),
            ),
        )
        return Batch(dev_ids, dev_pos, meta, logit_rows, last_token_index, None, slots, starts)

    def _prepare_graph(
        self,
        key: tuple[str, int],
        arrays: tuple,
        starts: np.ndarray,
        logit_rows: list[int],
        last: list[int],
    ) -> Batch:
        """Fill a graph's static inputs (padding included: see `StepGraphs.pack`) in one copy."""
        slots = arrays[3]
        step = self.graphs[key]
        step.inputs.copy_(self.staging.stage(self.graphs.pack(key, arrays)), non_blocking=True)
        self.staging.staged()
        torch.index_select(self.tables.device_table, 0, step.rows, out=step.tables)
        return Batch(step.ids, step.positions, None, logit_rows, last, key, slots, starts)

    # ------------------------------------------------------------------ block copies

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = self.staging.to_device(np.array([s for s, _ in copies], dtype=np.int64))
        dst = self.staging.to_device(np.array([d for _, d in copies], dtype=np.int64))
        self._kv[:, :, dst] = self._kv[:, :, src]  # every layer's K and V in one copy
        self.tables.invalidate()  # a copy-on-write replaced a block id inside some table

    # ------------------------------------------------------------------ swapping

    @torch.inference_mode()
    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Move blocks between the device pool and the host pool: `swap_out` (device, host)
        first, then `swap_in` (host, device). Queued before the step's copies and forward pass,
        in stream order, so a freed device block is read before anything writes it again."""
        self.host_kv.swap_out([d for d, _ in swap_out], [h for _, h in swap_out])
        self.host_kv.swap_in([h for h, _ in swap_in], [d for _, d in swap_in])

    def close(self) -> None:
        """Free the KV cache, the host pool and graphs (the model stays)."""
        if self.graphs is not None:
            self.graphs.clear()
        self.kv_caches = []
        self._kv = None
        self.host_kv.close()
        self.tables.clear()
        self.processors.clear()

    # ------------------------------------------------------------------ sampling state

    def _generator(self, seq: Sequence, sample_index: int) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None:
            return None
        key = (seq.request_id, sample_index)
        gen = self._generators.get(key)
        if gen is None:
            gen = self._generators[key] = make_generator(seed, sample_index, self.device)
        return gen

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence: its generator and its block-table row."""
        self._generators.pop((seq.request_id, seq.sample_index), None)
        self.tables.release(seq.seq_id)
        self.processors.release(seq)
