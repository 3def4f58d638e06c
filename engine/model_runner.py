"""Turns a `SchedulerOutput` into one flat varlen batch, runs the model and samples.

The runner reads sequences (tokens, `num_computed_tokens`, block tables) and never writes them; it
owns the KV cache tensors and the per-sequence random generators.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch
from torch import Tensor

from engine.models.attention import AttentionMetadata
from engine.sampler import Sampler, make_generator
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence

GeneratorKey = tuple[str, int]  # (request_id, sample_index)


@dataclass
class StepResult:
    """Tokens drawn for each row (`[]` for a prefill chunk) and, where asked, their logprobs."""

    sampled_token_ids: list[list[int]]
    logprobs: list[list[float]] | None


class Batch(NamedTuple):
    input_ids: Tensor  # int64 [num_tokens]
    positions: Tensor  # int64 [num_tokens]
    meta: AttentionMetadata
    logit_rows: list[int]  # rows of the SchedulerOutput that sample
    last_token_index: list[int]  # for each of those rows, its last token in the flat batch


class ModelRunner:
    """Runs one scheduler step on the model, reading and writing the paged KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        seed: int | None = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        # Left uninitialised: attention reads only slots its sequence has written, and the
        # memory is committed as it is first written (a 4 GiB CPU pool costs nothing up front).
        self.kv_caches = [
            (
                torch.empty(shape, dtype=kv_dtype, device=device),
                torch.empty(shape, dtype=kv_dtype, device=device),
            )
            for _ in range(model.num_layers)
        ]
        self.sampler = Sampler(seed)
        self._generators: dict[GeneratorKey, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Copy-on-write copies, one forward pass over every scheduled token, then sampling."""
        if out.copies:
            self._copy_blocks(out.copies)
        batch = self._prepare(out)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        sampled: list[list[int]] = [[] for _ in out.seqs]
        logit_rows = batch.logit_rows
        if not logit_rows:
            return StepResult(sampled, None)
        seqs = [out.seqs[i] for i in logit_rows]
        counts = [s.num_samples_to_draw for s in seqs]
        last = batch.last_token_index
        idx = torch.tensor(
            [t for t, k in zip(last, counts, strict=True) for _ in range(k)], device=self.device
        )
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        params, generators = [], []
        for seq, k in zip(seqs, counts, strict=True):
            for j in range(k):
                params.append(seq.sampling_params)
                generators.append(self._generator(seq, j if k > 1 else seq.sample_index))
        result = self.sampler(logits, params, generators)
        logprobs: list[list[float]] | None = (
            None if result.logprobs is None else [[] for _ in out.seqs]
        )
        pos = 0
        for row, k in zip(logit_rows, counts, strict=True):
            sampled[row] = result.token_ids[pos : pos + k]
            if logprobs is not None:
                logprobs[row] = result.logprobs[pos : pos + k]
            pos += k
        return StepResult(sampled, logprobs)

    def _prepare(self, out: SchedulerOutput) -> Batch:
        seqs, nums = out.seqs, out.num_new_tokens
        starts = [s.num_computed_tokens for s in seqs]
        ids = list(
            chain.from_iterable(
                s.token_ids[c : c + n] for s, c, n in zip(seqs, starts, nums, strict=True)
            )
        )
        logit_rows = [
            i
            for i, (s, c, n) in enumerate(zip(seqs, starts, nums, strict=True))
            if c + n == s.num_tokens
        ]
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = torch.tensor(
            [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs],
            dtype=torch.int32,
        )
        q_lens = torch.tensor(nums, dtype=torch.int64)
        starts_t = torch.tensor(starts, dtype=torch.int64)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=cu[1:])
        row = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        positions = starts_t[row] + torch.arange(len(ids)) - cu[:-1][row]
        block_ids = tables[row, positions // self.block_size].to(torch.int64)
        slots = block_ids * self.block_size + positions % self.block_size
        seq_lens = starts_t + q_lens
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev, non_blocking=True),
            block_tables=tables.to(dev, non_blocking=True),
            seq_lens=seq_lens.to(torch.int32).to(dev, non_blocking=True),
            cu_seqlens_q=cu.to(torch.int32).to(dev, non_blocking=True),
            max_seqlen_q=max(nums),
            max_seqlen_k=int(seq_lens.max()),
        )
        ends = cu[1:].tolist()
        return Batch(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=positions.to(dev, non_blocking=True),
            meta=meta,
            logit_rows=logit_rows,
            last_token_index=[ends[i] - 1 for i in logit_rows],
        )

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

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
        """Forget a finished sequence's generator."""
        self._generators.pop((seq.request_id, seq.sample_index), None)
