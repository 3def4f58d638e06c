"""FCFS scheduler with a token budget, chunked prefill and preemption by recompute or swap.

One step, top to bottom:
1. Running sequences, oldest first, each get `min(remaining tokens, budget)` new tokens. When the
   pool cannot hold them, the most recently admitted running sequence is preempted (blocks freed,
   back to the front of the waiting queue to be recomputed, or moved to the host pool), until it
   fits or the sequence itself was the victim.
2. Only if nothing was preempted: swapped-out units in the order they were admitted, each
   brought back when its blocks and its next tokens fit; the first that does not stops this
   (or, alone with the whole pool, goes to the front of `waiting` to be recomputed).
3. Only if nothing was preempted and nothing is left swapped out: waiting sequences in arrival
   order, each after its prefix-cache lookup (so a hit is not charged to the budget), while the
   budget, `max_num_seqs` and the pool allow. The first one that does not fit stops admission
   (strict FCFS). A sequence resuming from preemption is admitted only if its whole remaining
   prefill fits the pool, so it cannot thrash.

A beam-search group (`engine.beam_search`) is one unit throughout: its live beams sit side by side
in the running list, are scheduled in the same step with the same number of tokens or not at all,
and are preempted together; a preempted group comes back as one sequence (its leader).

Preemption mode (`SchedulerConfig.preemption_mode`): `recompute` frees a victim's blocks and
computes its tokens again; `swap` copies them to the host pool first (`KVCacheManager.swap_out`)
and back before new admissions; `auto` picks per victim from `PreemptionCosts`. A swap the host
pool cannot take falls back to recompute (counted in `num_swap_fallbacks`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from .beam_search import BeamGroup, BeamStats
from .config import CacheConfig, SchedulerConfig
from .kv_cache_manager import CopyOp, KVCacheManager
from .multistep import DecodeWindow
from .sequence import Sequence, SequenceStatus
from .swap import PreemptionCosts
from .units import cdiv


@dataclass
class SchedulerOutput:
    """What the runner executes in one step.

    `seqs[i]` gets `num_new_tokens[i]` tokens starting at its `num_computed_tokens`, through its
    `block_table` (both read before `Scheduler.update`). `copies` are copy-on-write block copies to
    do before any KV write. A row samples when it reaches the end of its tokens; it then draws
    `seq.num_samples_to_draw` tokens. `swap_out` and `swap_in` are block transfers to
    make before either (`ModelRunner.swap`).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)
    swap_out: list[CopyOp] = field(default_factory=list)  # (device block, host block)
    swap_in: list[CopyOp] = field(default_factory=list)  # (host block, device block)
    preempted: list[Sequence] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0


@dataclass
class SchedulerStats:
    """Scheduler counters, summed over the scheduler's life (the prefix cache has its own)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_swap_outs: int = 0  # preemptions by swap (counted in num_preemptions too)
    num_swap_ins: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_swap_fallbacks: int = 0  # swaps the host pool could not take: recomputed instead
    num_recomputed_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_finished: int = 0
    num_refused: int = 0
    waste_slot_steps: int = 0  # sum over steps of allocated slots not holding a token
    peak_waste_slots: int = 0


class Scheduler:
    """Decides which sequences run in each step and owns their status and counters."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        costs: PreemptionCosts | None = None,
    ) -> None:
        """`costs` decide `auto` preemption (without them `auto` swaps while the host has room)."""
        self.config = scheduler_config
        self.kv = KVCacheManager(cache_config)
        self.costs = costs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[list[Sequence]] = deque()  # units on the host, oldest first
        self.stats = SchedulerStats()
        self.beam_stats = BeamStats()  # summed over the beam groups that ended
        self._finished_in_schedule: list[Sequence] = []  # reported by the next update()
        self._num_pending_forks = 0  # children that running, not yet forked parents will add
        self.window = DecodeWindow(self.kv, scheduler_config.max_model_len, self.stats)

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; one that can never run is finished at once, its reason in `seq.error`
        and its code in `seq.error_code`."""
        refusal = self._refusal(seq)
        if refusal is not None:
            seq.error_code, seq.error = refusal
            seq.status = SequenceStatus.FINISHED_ERROR
            self.stats.num_refused += 1
            return
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def _refusal(self, seq: Sequence) -> tuple[str, str] | None:
        """(error code, message) for a sequence that must not run, else None."""
        n = seq.num_prompt_tokens
        limit = self.config.max_model_len
        if n == 0:
            return "empty_prompt", "empty prompt: at least one token is needed"
        if n + 1 > limit:
            return (
                "prompt_too_long",
                f"prompt of {n} tokens leaves no room to generate within max_model_len={limit}",
            )
        if seq.beam is not None and seq.beam.width > self.config.max_num_batched_tokens:
            return (
                "beam_width_too_large",
                f"beam_width {seq.beam.width} is more than max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens}: a group's beams run in one step",
            )
        max_tokens = seq.sampling_params.max_tokens
        if seq.sampling_params.strict_max_tokens and n + max_tokens > limit:
            return (
                "context_length_exceeded",
                f"max_model_len is {limit} tokens, but the request asks for {n + max_tokens} "
                f"({n} in the prompt, {max_tokens} in max_tokens); lower max_tokens to at most "
                f"{limit - n}",
            )
        pool_tokens = self.kv.num_blocks * self.kv.block_size
        if cdiv(n + 1, self.kv.block_size) > self.kv.num_blocks:
            return (
                "prompt_too_long",
                f"prompt of {n} tokens plus one generated token needs "
                f"{cdiv(n + 1, self.kv.block_size)} KV blocks; the whole pool has "
                f"{self.kv.num_blocks} ({pool_tokens} tokens)",
            )
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + self.num_swapped

    @property
    def num_swapped(self) -> int:
        return sum(map(len, self.swapped))

    def unfinished(self) -> list[Sequence]:
        """Every sequence not finished: running, swapped out, waiting."""
        return [*self.running, *(s for unit in self.swapped for s in unit), *self.waiting]

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        # Only a preemption of this step holds admissions back: a swapped-out unit turned into
        # a recompute (`_drop_swapped`) waits at the front of `waiting`, to be admitted or
        # capped now, or the step would run nothing.
        preempted = bool(out.preempted)
        if not preempted and self.swapped:
            budget = self._schedule_swapped(out, budget)
        if not preempted and not self.swapped:
            budget = self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            unit = self._unit_at(i)
            m = len(unit)
            n = min(unit[0].num_tokens - unit[0].num_computed_tokens, budget // m)
            if n <= 0:  # a group whose beams do not all fit what is left waits for the next step
                i += m
                continue
            copies = self._allocate_unit(unit, n, out)
            if copies is None:
                return budget  # the unit itself was preempted or capped
            self._add_unit(out, unit, n, copies)
            budget -= n * m
            i += m
        return budget

    def _add_unit(self, out: SchedulerOutput, unit: list[Sequence], n: int, copies: list) -> None:
        for seq, seq_copies in zip(unit, copies, strict=True):
            self._add_row(out, seq, n, seq_copies)
        group = unit[0].beam
        if group is not None:
            group.stats.num_cow_copies += sum(map(len, copies))
            group.measure()

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        """Bring swapped-out units back, oldest first, while their blocks, their next tokens,
        the budget and `max_num_seqs` allow; each runs in this step."""
        swapped = self.swapped
        while swapped and budget > 0:
            unit = swapped[0]
            m = len(unit)
            n = min(unit[0].num_tokens - unit[0].num_computed_tokens, budget // m)
            if n <= 0:
                break
            reserved = sum(seq.num_seqs_reserved for seq in unit)
            seqs = len(self.running) + self._num_pending_forks + reserved
            if seqs > self.config.max_num_seqs and self.running:
                break
            need = self.kv.blocks_to_swap_in(unit, n)
            if need > self.kv.num_free_blocks:
                if self.running:
                    break
                # Alone with the whole pool and still no room (it grew while away, or the pool
                # is smaller than a group's worst case): recompute it instead of waiting forever.
                swapped.popleft()
                self._drop_swapped(unit, out)
                continue
            swapped.popleft()
            ops = self.kv.swap_in(unit)
            out.swap_in.extend(ops)
            self.stats.num_swap_ins += 1
            self.stats.num_swapped_in_blocks += len(ops)
            for seq in unit:
                seq.status = SequenceStatus.RUNNING
                self._num_pending_forks += seq.num_seqs_reserved - 1
            self.running.extend(unit)
            copies = [self.kv.allocate_slots(seq, n) for seq in unit]
            assert all(c is not None for c in copies), "a swap-in was admitted without room"
            self._add_unit(out, unit, n, copies)
            budget -= n * m
        return budget

    def _drop_swapped(self, unit: list[Sequence], out: SchedulerOutput) -> None:
        """Turn a swapped-out unit into one preempted by recompute (its host blocks freed): the
        same preemption, carried out another way, so counted once."""
        self._recompute(unit, out)
        self.stats.num_swap_fallbacks += 1

    def _allocate_unit(self, unit: list[Sequence], n: int, out: SchedulerOutput) -> list | None:
        """Slots for `n` more tokens of every sequence of `unit`, preempting the newest units
        until they fit; None when `unit` itself had to go (preempted, or capped when alone)."""
        running = self.running
        all_copies = []
        for seq in unit:
            assert seq.num_tokens - seq.num_computed_tokens >= n, "a unit steps together"
            copies = self.kv.allocate_slots(seq, n)
            while copies is None:
                victim = self._pop_last_unit()
                if victim[0] is unit[0]:
                    if running:  # beams given slots already hold uncopied blocks: recompute
                        self._preempt(victim, out, swap=not all_copies)
                    else:
                        self._cap_unit(victim, running=True)  # alone with the whole pool, no room
                    return None
                self._preempt(victim, out)
                copies = self.kv.allocate_slots(seq, n)
            all_copies.append(copies)
        return all_copies

    def _unit_of(self, seq: Sequence) -> list[Sequence]:
        """The sequences scheduled and preempted with `seq`: its group's live beams, or itself."""
        group = seq.beam
        if group is None or group.root is seq or group.leader is seq:
            return [seq]
        return group.seqs

    def _unit_at(self, i: int) -> list[Sequence]:
        unit = self._unit_of(self.running[i])
        if len(unit) > 1 and self.config.debug:
            assert self.running[i : i + len(unit)] == unit, unit  # (Sequence: equal is same)
        return unit

    def _pop_last_unit(self) -> list[Sequence]:
        unit = self._unit_of(self.running[-1])
        del self.running[-len(unit) :]
        return unit

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        waiting = self.waiting
        max_seqs = self.config.max_num_seqs
        while waiting and budget > 0:
            seq = waiting[0]
            group = seq.beam
            resume_blocks = group.blocks_to_resume(self.kv.block_size) if group else 0
            if max(cdiv(seq.num_tokens, self.kv.block_size), resume_blocks) > self.kv.num_blocks:
                waiting.popleft()
                self._cap_unit([seq], running=False)  # outgrew the whole pool while preempted
                continue
            num_samples = seq.num_seqs_reserved
            num_slots = len(self.running) + self._num_pending_forks + num_samples
            if num_slots > max_seqs and self.running:
                break  # (a request with n > max_num_seqs still runs, alone)
            hit, num_hit = self.kv.get_computed_blocks(seq)
            remaining = seq.num_tokens - num_hit
            n = min(remaining, budget)
            # A resumed sequence must fit whole, or it would be preempted again (thrash).
            reserve = remaining - n if seq.status == SequenceStatus.PREEMPTED else 0
            copies = self.kv.allocate_slots(
                seq, n, hit, num_reserved_tokens=reserve, num_reserved_blocks=resume_blocks
            )
            if copies is None:
                break
            waiting.popleft()
            self._num_pending_forks += num_samples - 1
            self.kv.record_query(seq, num_hit)
            seq.num_computed_tokens = num_hit
            seq.num_cached_tokens += num_hit
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_row(out, seq, n, copies)
            budget -= n
        return budget

    def _add_row(self, out: SchedulerOutput, seq: Sequence, n: int, copies: tuple) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        if copies:
            out.copies.extend(copies)
        c = seq.num_computed_tokens
        if c < seq._max_computed_tokens:
            recomputed = min(c + n, seq._max_computed_tokens) - c
            seq.num_recomputed_tokens += recomputed
            self.stats.num_recomputed_tokens += recomputed
        if n == 1 and c >= seq.num_prompt_tokens:
            self.stats.num_decode_tokens += 1
        else:
            self.stats.num_prefill_tokens += n

    def _preempt(self, unit: list[Sequence], out: SchedulerOutput, swap: bool = True) -> None:
        """Take a unit (out of `running`) off the device: to the host pool where the mode
        says so and the host has room, else freed, to be recomputed."""
        for seq in unit:
            self._num_pending_forks -= seq.num_seqs_reserved - 1
        group = unit[0].beam  # a group counts its preemptions, a sequence its own
        if group is not None:
            group.num_preemptions += 1
        else:
            unit[0].num_preemptions += 1
        self.stats.num_preemptions += 1
        mode = self.config.preemption_mode
        if swap and mode != "recompute" and (mode == "swap" or self._swap_pays(unit)):
            ops = self.kv.swap_out(unit)
            if ops is not None:
                for seq in unit:
                    seq.status = SequenceStatus.SWAPPED
                self.swapped.appendleft(unit)  # victims go newest first: arrival order kept
                self.stats.num_swap_outs += 1
                self.stats.num_swapped_out_blocks += len(ops)
                out.swap_out.extend(ops)
                out.preempted.extend(unit)
                return
            self.stats.num_swap_fallbacks += 1
        self._recompute(unit, out)

    def _swap_pays(self, unit: list[Sequence]) -> bool:
        """`auto`: is swapping this unit out and back cheaper than computing its KV again?"""
        if self.costs is None:
            return True
        blocks = len({b for seq in unit for b in self.kv.held_blocks(seq)})
        tokens = min(sum(seq.num_computed_tokens for seq in unit), blocks * self.kv.block_size)
        return self.costs.prefers_swap(blocks, tokens)

    def _recompute(self, unit: list[Sequence], out: SchedulerOutput) -> None:
        """Free every block of a preempted unit (counted by the caller, its pending forks off)
        and queue it at the front of `waiting`: its one sequence, or a beam group's leader."""
        for seq in unit:
            self.kv.free(seq)
            seq.status = SequenceStatus.PREEMPTED
            seq.num_computed_tokens = 0
        head = unit[0] if unit[0].beam is None else unit[0].beam.preempt()
        head.status = SequenceStatus.PREEMPTED
        head.num_computed_tokens = 0
        self.waiting.appendleft(head)
        out.preempted.extend(unit)

    # ------------------------------------------------------------------ update

    def update(
        self,
        out: SchedulerOutput,
        sampled_token_ids: list[list[int]],
        logprobs: list[list[float]] | None = None,
    ) -> list[Sequence]:
        """Apply a step's results; return the sequences that finished in it.

        `sampled_token_ids[i]` holds the tokens drawn for `out.seqs[i]`: empty for a row that did
        not reach the end of its tokens (a prefill chunk), else `seq.num_samples_to_draw` tokens;
        for a beam, its candidates best first, with their log-probabilities in `logprobs[i]`.
        Beams the group let go are among the sequences returned (status FINISHED_PRUNED).
        """
        finished, self._finished_in_schedule = self._finished_in_schedule, []
        reported: dict[int, tuple[BeamGroup, dict]] = {}
        rows = zip(out.seqs, out.num_new_tokens, sampled_token_ids, strict=True)
        for i, (seq, n, sampled) in enumerate(rows):
            if seq.is_finished:  # finished from outside (abort, stop string) during the step
                continue
            seq.num_computed_tokens += n
            if seq.num_computed_tokens > seq._max_computed_tokens:
                seq._max_computed_tokens = seq.num_computed_tokens
            self.kv.cache_blocks(seq)
            self.kv.drop_out_of_window(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                assert not sampled, f"sampled a token for a partial prefill of {seq}"
                continue
            if seq.beam is not None:
                entry = reported.setdefault(id(seq.beam), (seq.beam, {}))
                entry[1][seq.seq_id] = (sampled, logprobs[i])
                continue
            if len(sampled) > 1:
                self._fork(seq, sampled[1:], finished)
            self._append_token(seq, sampled[0], finished)
        for group, candidates in reported.values():
            self._advance_group(group, candidates, finished)
        if finished:
            self.running = [s for s in self.running if not s.is_finished]
        self.stats.num_steps += 1
        self._account_waste()
        if self.config.debug:
            self.check_invariants()
        return finished

    # ------------------------------------------------------------------ beam groups

    def _advance_group(self, group: BeamGroup, candidates: dict, finished: list[Sequence]) -> None:
        """Put the group's sequences after its step (`BeamGroup.advance`) in its place in
        `running`; the beams it let go finish pruned, their blocks freed tail first."""
        heads = group.seqs
        pos = next(i for i, s in enumerate(self.running) if s is heads[0])
        self._num_pending_forks -= sum(s.num_seqs_reserved - 1 for s in heads)
        live, released = group.advance(candidates, self.config.max_model_len, self.kv)
        self.running[pos : pos + len(heads)] = live
        for seq in released:
            self._release_beam(seq, finished)
        if group.done:
            self._end_group(group)

    def _release_beam(self, seq: Sequence, finished: list[Sequence]) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED_PRUNED
        finished.append(seq)

    def _end_group(self, group: BeamGroup) -> None:
        self.stats.num_finished += 1
        self.beam_stats.add(group.stats)

    def _cap_unit(self, unit: list[Sequence], running: bool) -> None:
        """Finish a unit that needs more KV than the whole pool holds, just taken out of
        `running` or `waiting`; a beam group ends with its hypotheses and its live beams."""
        if running:
            self._num_pending_forks -= sum(seq.num_seqs_reserved - 1 for seq in unit)
        group = unit[0].beam
        if group is None:
            self._cap(unit[0])
            return
        beams = [b.seq for b in group.beams]
        group.cap()
        for seq in {id(s): s for s in [*unit, *beams]}.values():
            if not seq.is_finished:
                self._release_beam(seq, self._finished_in_schedule)
        self._end_group(group)

    def _fork(self, parent: Sequence, tokens: list[int], finished: list[Sequence]) -> None:
        self._num_pending_forks -= len(tokens)
        for i, token in enumerate(tokens, start=1):
            child = parent.fork(sample_index=i)
            self.kv.fork(parent, child)
            self.running.append(child)
            self._append_token(child, token, finished)

    def _append_token(self, seq: Sequence, token: int, finished: list[Sequence]) -> None:
        seq.token_ids.append(token)
        params = seq.sampling_params
        if (token == seq.eos_token_id and not params.ignore_eos) or params.is_stop_token(token):
            self._finish(seq, SequenceStatus.FINISHED_STOPPED, token)
        elif seq.num_output_tokens >= params.max_tokens:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH)
        elif seq.num_tokens >= self.config.max_model_len:
            self._finish(seq, SequenceStatus.FINISHED_LENGTH, "max_model_len")
        else:
            return
        finished.append(seq)

    def finish(self, seqs: Iterable[Sequence], status: SequenceStatus, reason=None) -> None:
        """Finish sequences from outside (stop string matched, request cancelled)."""
        for seq in seqs:
            if not seq.is_finished:
                if seq in self.running:
                    self.running.remove(seq)
                    self._num_pending_forks -= seq.num_seqs_reserved - 1
                elif seq in self.waiting:
                    self.waiting.remove(seq)
                elif seq.status == SequenceStatus.SWAPPED:
                    self._unswap(seq)
                self._finish(seq, status, reason)

    def _unswap(self, seq: Sequence) -> None:
        """Take a sequence finished from outside out of its swapped-out unit."""
        for unit in self.swapped:
            if seq in unit:
                unit.remove(seq)
                if not unit:
                    self.swapped.remove(unit)
                return

    def fail(self, seqs: Iterable[Sequence], code: str, message: str) -> None:
        """Finish sequences with an error; one already finished (its output could not be made)
        is marked failed too, its blocks being already free."""
        seqs = list(seqs)
        for seq in seqs:
            seq.error_code, seq.error = code, message
            if seq.is_finished:
                seq.status = SequenceStatus.FINISHED_ERROR
        self.finish(seqs, SequenceStatus.FINISHED_ERROR)

    def _finish(self, seq: Sequence, status: SequenceStatus, reason=None) -> None:
        assert status.is_finished
        seq.status = status
        seq.stop_reason = reason
        if seq.block_table:
            seq.tail_waste = len(seq.block_table) * self.kv.block_size - seq.num_computed_tokens
        self.kv.free(seq)
        self.stats.num_finished += 1

    def _cap(self, seq: Sequence) -> None:
        """Finish a sequence that needs more KV than the whole pool holds (never retried)."""
        self._finish(seq, SequenceStatus.FINISHED_LENGTH, "kv_cache_full")
        self._finished_in_schedule.append(seq)

    def _account_waste(self) -> None:
        waste = 0
        bs = self.kv.block_size
        for seq in self.running:
            waste += len(seq.block_table) * bs - seq.num_computed_tokens
        self.stats.waste_slot_steps += waste
        if waste > self.stats.peak_waste_slots:
            self.stats.peak_waste_slots = waste

    def check_invariants(self) -> None:
        """Assert docs/design.md's invariants: pool accounting, ref counts, a table per sequence."""
        self.kv.check_integrity(self.running, self.window.lookahead)
        assert all(not s.block_table for s in self.waiting), "a waiting sequence holds blocks"
        for unit in self.swapped:
            for seq in unit:
                assert seq.status == SequenceStatus.SWAPPED and not seq.block_table, seq
                assert len(self.kv.host_table(seq)) + seq.num_dropped_blocks == cdiv(
                    seq.num_computed_tokens, self.kv.block_size
                ), seq
        pending = sum(s.num_seqs_reserved - 1 for s in self.running)
        assert pending == self._num_pending_forks, (pending, self._num_pending_forks)
        assert len(self.running) + pending <= self.config.max_num_seqs or (
            len({s.request_id for s in self.running}) == 1
        ), "max_num_seqs exceeded"
        i = 0
        while i < len(self.running):
            unit = self._unit_at(i)  # a group's beams side by side, in the group's order
            for seq in unit:
                assert seq.status == SequenceStatus.RUNNING, seq
            i += len(unit)
