"""One `pagedctl capacity` invocation: the sections computed, printed and written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pagedctl.capacity import inputs, plan, report, sim
from pagedctl.capacity.recipe import as_list, compare_rows
from pagedctl.console import Format, print_json, print_tsv, progress_console, stdout_console
from pagedctl.engine import format_bytes
from pagedctl.outputs import ResultFolder


class CapacityRun:
    """Checked inputs (from merged flags and recipe), then sections 1-5, then the files."""

    def __init__(self, s: dict, command: str) -> None:
        self.settings, self.command = s, command  # the merged flags and recipe keys
        self.fp, self.dtype, self.dtype_bytes = inputs.resolve_model(s)
        self.inputs = inputs.plan_inputs(s, self.fp, self.dtype, self.dtype_bytes)
        self.lengths = inputs.lengths_of(s, self.fp, self.inputs.max_len)
        self.sections: list[report.Section] = []
        self.figures: dict[str, float] = {}
        self.doc: dict[str, Any] = {}

    # ------------------------------------------------------------------ sections

    def section_keys(self, simulate: bool, probe: bool) -> list[str]:
        """The sections this run computes, in order: what `compute` makes and `emit` writes."""
        lengths = self.lengths is not None
        wanted = {
            "pool": True,
            "lengths": True,
            "blocks": lengths,
            "swap": self.inputs.swap_space_bytes is not None,
            "sim": lengths and simulate,
            "probe": probe,
            "compare": bool(self.settings.get("compare")),
        }
        return [key for key, on in wanted.items() if on]

    def compute(self, simulate: bool, probe: bool) -> None:
        inp = self.inputs
        self.mem = plan.memory(inp)
        self.pools = plan.pools(inp, self.mem)
        self.primary = plan.primary(inp, self.pools)
        if self.primary.num_blocks < 1:
            inputs.fail(
                f"no KV block fits: the budget at --gpu-mem {inp.gpu_mems[0]:g} is "
                f"{format_bytes(self.primary.budget_bytes)} after "
                f"{format_bytes(self.mem.non_kv_bytes)} of non-KV memory; raise --gpu-mem, "
                "use a larger card or a smaller model"
            )
        self._pool_sections()  # "pool" and "lengths"
        more = {
            "blocks": self._block_section,
            "swap": self._host_section,
            "sim": self._sim_section,
            "probe": self._probe_section,
            "compare": self._compare_section,
        }
        for key in self.section_keys(simulate, probe)[2:]:
            more[key]()

    def _pool_sections(self) -> None:
        inp, pool = self.inputs, self.primary
        rows = plan.pool_rows(inp, self.pools)
        note = [f"vLLM's line for this pool: {plan.vllm_line(pool, inp.max_len)}"]
        self.sections.append(report.Section("pool", "1. KV pool", report.POOL_COLUMNS, rows, note))
        cap = plan.capacity_rows(inp, pool, self.mem)
        reserved = plan.reserved_tokens(inp)
        reservation = reserved * inp.layout.bytes_per_token
        what = (
            f"--max-len {inp.max_len:,} tokens"
            if reserved == inp.max_len
            else f"its {reserved:,}-token sliding window (a ring buffer)"
        )
        notes = [
            f"paged: {pool.num_blocks:,} blocks of {pool.block_size} ({_frac(pool.utilization)}); "
            f"contiguous: one {format_bytes(reservation)} "
            f"reservation of {what} per sequence, whatever its length",
            "same budget: the engine's KV budget; whole card: the card less the weights and the "
            f"CUDA context ({format_bytes(inp.cuda_context_bytes)}, assumed; --probe measures "
            "it), an upper bound that leaves nothing for activations",
        ]
        if inp.shared_prefix:
            notes.append(f"paged sequences share their first {inp.shared_prefix} tokens' blocks")
        if inp.footprint.kv_window:
            notes.append(
                f"sliding window {inp.footprint.kv_window:,} on every layer: a paged sequence "
                "gives back the blocks before its window and holds the window's blocks and one more"
            )
        self.sections.append(
            report.Section("lengths", "2. Sequences that fit", report.CAPACITY_COLUMNS, cap, notes)
        )
        self.pool_rows, self.cap_rows = rows, cap

    def _block_section(self) -> None:
        rows = plan.block_rows(self.inputs, self.lengths, self.pools)
        self.block_rows = rows
        notes = [
            f"over {self.lengths.source}: mean {rows[0]['mean_len']:.1f} tokens per sequence "
            f"(cut at --max-len {self.inputs.max_len:,}); a sequence wastes the unfilled tail of "
            "its last block"
        ]
        self.sections.append(
            report.Section("blocks", "3. Block-size waste", report.BLOCK_COLUMNS, rows, notes)
        )

    def _host_section(self) -> None:
        inp = self.inputs
        rows = plan.host_rows(inp, self.lengths)
        self.host_rows = rows
        if self.lengths is not None:
            at = (
                f"the mean of {self.lengths.source} ({rows[0]['mean_blocks']:.1f} blocks of "
                f"{rows[0]['block_size']}) and at --max-len {inp.max_len:,}"
            )
        else:
            at = f"--max-len {inp.max_len:,} (give --lengths or --dist for the mean)"
        notes = [
            f"--swap-space {self.settings['swap_space']:g} GiB of host memory (pinned on CUDA) for "
            "--preemption-mode swap or auto: it holds sequences preempted off the device, never "
            "running ones, so the running capacity above is unchanged",
            f"preempted seqs: host blocks / blocks per sequence, at {at}; one preempted part way "
            "holds fewer blocks, so more may fit; requests share no block on the host (a beam "
            "group's beams do)",
        ]
        self.sections.append(
            report.Section(
                "swap",
                "Host pool for preempted sequences (--swap-space)",
                report.HOST_COLUMNS,
                rows,
                notes,
            )
        )

    def _sim_section(self) -> None:
        s, pool, inp = self.settings, self.primary, self.inputs
        loads = inputs.floats(s["loads"], "--loads", 0.0, 100.0)
        n = int(s["requests"])
        stream = sim.make_stream(self.lengths, n, int(s["seed"]))
        results = sim.simulate(
            stream,
            num_blocks=pool.num_blocks,
            block_size=pool.block_size,
            max_len=inp.max_len,
            loads=list(loads),
        )
        self.sim_results = results
        rows = [r.as_dict() for r in results]
        slots = pool.tokens // inp.max_len
        predicted = [sim.erlang_b(slots, sim.offered_slots(stream, pool.tokens, x)) for x in loads]
        erlang = [f"{x:g}: {100 * b:.2f}%" for x, b in zip(loads, predicted, strict=True)]
        wall = sum(r.wall_s for r in results)
        k = self.lengths.num_sequences
        drawn = f" (drawn with replacement from its {k:,} sequences)" if k else ""
        notes = [
            f"{n:,} requests per load from {self.lengths.source}{drawn} (first "
            f"{int(100 * sim.WARMUP_SHARE)}% are warm-up), Poisson arrivals; each holds its "
            "tokens from admission to the end of its life (one step per output token); a request "
            "that cannot be placed on arrival is refused",
            f"pool: {pool.tokens:,} tokens ({pool.num_blocks:,} blocks of {pool.block_size}; "
            f"{slots:,} max-length slots); load = offered token-time / pool",
            "occupancy = memory held, utilisation = tokens the live sequences hold, both averaged "
            "over time; @refusal = at the moment of each refusal (external = free memory that "
            "could not hold the refused request)",
            f"reservation refusals by Erlang's loss formula ({slots:,} slots): "
            + ", ".join(erlang),
            f"simulated in {wall:.1f} s",
        ]
        if inp.shared_prefix:
            notes.append("--shared-prefix is not simulated: every sequence holds all its blocks")
        self.sections.append(
            report.Section(
                "sim",
                "4. Simulation: same arrivals, three allocators",
                report.SIM_COLUMNS,
                rows,
                notes,
            )
        )

    def _probe_section(self) -> None:
        from pagedctl.capacity import probe

        inp = self.inputs
        reservation = inp.max_len * inp.layout.bytes_per_token
        try:
            contiguous = probe.probe_contiguous(reservation, self.mem.weights_bytes)
        except probe.ProbeError as e:
            inputs.fail(str(e), code=1)
        notes = []
        try:
            engine = probe.probe_engine(
                str(self.settings["model"]),
                list(inp.gpu_mems),
                inp.block_sizes[0],
                self.dtype,
                inp.max_len,
                cuda_graphs=inp.cuda_graphs,
            )
        except (probe.ProbeError, ValueError) as e:
            engine, notes = [], [f"engine not probed: {e}"]
        estimate = {
            "total_bytes": inp.card.total_bytes if inp.card else None,
            "cuda_context_bytes": inp.cuda_context_bytes,
            "contiguous_whole_card": plan.contiguous_whole_card(inp, self.mem),
            "weights_bytes": self.mem.weights_bytes,
            "activation_peak_bytes": self.mem.activation_peak_bytes,
            "graph_reserve_bytes": self.mem.graph_reserve_bytes,
            "non_kv_bytes": self.mem.non_kv_bytes,
            "pools": {
                g: p.num_blocks for (g, bs), p in self.pools.items() if bs == inp.block_sizes[0]
            },
        }
        rows = probe.probe_rows(estimate, contiguous, engine)
        notes.insert(
            0,
            f"{contiguous['device_name']}: {contiguous['reservations']:,} "
            f"reservations of {format_bytes(reservation)} fit beside a "
            f"{format_bytes(self.mem.weights_bytes)} stand-in for the weights",
        )
        self.doc["probe"] = {"contiguous": contiguous, "engine": engine}
        self.sections.append(
            report.Section(
                "probe", "5. Probe: measured beside estimated", report.PROBE_COLUMNS, rows, notes
            )
        )

    def _compare_section(self) -> None:
        self.figures = figures(self)
        rows = compare_rows(self.figures, self.settings["compare"])
        notes = list(as_list(self.settings.get("notes")))
        title = "Reference figures beside ours"
        if self.settings.get("compare_source"):
            title += f" ({self.settings['compare_source']})"
        self.sections.append(report.Section("compare", title, report.COMPARE_COLUMNS, rows, notes))

    # ------------------------------------------------------------------ output

    def header(self) -> list[str]:
        fp, inp, mem = self.fp, self.inputs, self.mem
        lay = inp.layout
        lines = [
            f"model: {fp.name} ({fp.config.get('model_type')}, {lay.num_layers} layers, "
            f"{lay.num_kv_heads} KV heads x {lay.head_dim}, {fp.num_params:,} parameters from "
            f"the {fp.params_source}); {self.dtype}: {lay.bytes_per_token:,} KV bytes per token",
        ]
        if inp.card is not None:
            lines.append(f"card: {format_bytes(inp.card.total_bytes)} ({inp.card.source})")
        if mem.given:
            lines.append(
                f"non-KV memory: {format_bytes(mem.non_kv_bytes)} = "
                f"{mem.non_kv_bytes / 1e9:.2f} GB (given)"
            )
        else:
            graphs = (
                f" + CUDA-graph reserve {format_bytes(mem.graph_reserve_bytes)} (the pool the "
                "engine's step graphs keep, as large as that peak; --no-cuda-graphs: none)"
                if mem.graph_reserve_bytes
                else " (no CUDA-graph reserve: --no-cuda-graphs)"
            )
            lines.append(
                f"non-KV memory: {format_bytes(mem.non_kv_bytes)} = weights "
                f"{format_bytes(mem.weights_bytes)} (quantization {inp.quantization}) + "
                "activation peak "
                f"{format_bytes(mem.activation_peak_bytes)} (estimated for the engine's profile "
                f"step: {mem.batched_tokens:,} tokens, {mem.logit_rows:,} logit rows){graphs}"
            )
        lines += [f"note: {n}" for n in (*fp.notes, *(self.lengths.notes if self.lengths else ()))]
        if self.lengths is None:
            lines.append("give --lengths or --dist for block-size waste and the simulation")
        return lines

    def stem(self) -> str:
        name = self.settings.get("name") or "-".join(
            x for x in (_model_stem(str(self.settings["model"])), self.settings.get("gpu")) if x
        )
        return "capacity-" + re.sub(r"[^A-Za-z0-9._-]+", "-", str(name)).strip("-")

    def file_names(self, simulate: bool, probe: bool, plot: bool) -> list[str]:
        """The files `emit` writes for these sections (`report.write_all`, `plot.write_plots`)."""
        keys = self.section_keys(simulate, probe)
        stem = self.stem()
        names = report.file_names(stem, keys)
        if plot:
            names += [f"{stem}-capacity.png", *([f"{stem}-refusals.png"] if "sim" in keys else [])]
        return names

    def emit(self, plot: bool, folder: ResultFolder, fmt: Format = Format.table) -> None:
        from pagedctl.envinfo import environment

        header = self.header()
        command = self.command
        self.doc.update(
            command=command,
            environment=environment(),
            header=header,
            memory={**self.mem.as_dict(), "quantization": self.inputs.quantization},
            sections={sec.key: sec.rows for sec in self.sections},
            figures=self.figures or figures(self),
        )
        if fmt is Format.json:
            print_json(self.doc)
        elif fmt is Format.tsv:
            print_tsv(
                (sec.title, [h for _, h, _ in sec.columns], sec.cells()) for sec in self.sections
            )
        else:
            report.print_sections(stdout_console(), header, self.sections)
        stem = self.stem()
        written = report.write_all(
            folder.path(),
            stem,
            f"pagedctl capacity: {stem}",
            [f"`{command}`", *header],
            self.sections,
            self.doc,
        )
        if plot:
            from pagedctl.capacity.plot import write_plots

            written += write_plots(folder.path(), stem, self)
        progress_console(fmt).print(
            "wrote " + ", ".join(map(str, written)), markup=False, highlight=False, soft_wrap=True
        )


def _frac(g: float | None) -> str:
    return "given by --num-blocks" if g is None else f"gpu mem {g:g}"


def figures(run: CapacityRun) -> dict[str, float]:
    """Named figures of this run, for reference comparisons (`compare` in a recipe)."""
    f: dict[str, float] = {
        "bytes_per_token": run.inputs.layout.bytes_per_token,
        "weights_bytes": run.mem.weights_bytes,
        "non_kv_bytes": run.mem.non_kv_bytes,
        "kv_tokens": run.primary.tokens,
        "num_blocks": run.primary.num_blocks,
    }
    first = run.inputs.block_sizes[0]
    for (g, bs), pool in run.pools.items():
        if bs == first and g is not None:
            f[f"kv_tokens@{g:g}"] = pool.tokens
    for row in run.cap_rows:
        n = row["seq_len"]
        f[f"paged@{n}"] = row["paged"]
        f["contiguous_same_budget"] = row["contiguous_same_budget"]
        if row["contiguous_whole_card"] is not None:
            f["contiguous_whole_card"] = row["contiguous_whole_card"]
        for k in ("ratio_same_budget", "ratio_whole_card"):
            if row[k] is not None:
                f[f"{k}@{n}"] = row[k]
    for row in getattr(run, "host_rows", []):
        for k in ("host_blocks", "preempted_at_mean", "preempted_at_max_len"):
            if row[k] is not None:
                f[f"{k}@{row['block_size']}"] = row[k]
    for row in getattr(run, "block_rows", []):
        for k in ("waste_tokens", "waste_share", "sequences_held"):
            f[f"{k}@{row['block_size']}"] = row[k]
    by_load: dict[float, dict[str, sim.AllocatorResult]] = {}
    for r in getattr(run, "sim_results", []):
        by_load.setdefault(r.load, {})[r.allocator] = r
        for k, v in r.as_dict().items():
            if isinstance(v, int | float) and k not in ("load", "wall_s") and v is not None:
                f[f"sim.{r.allocator}.{k}@{r.load:g}"] = v
    for load, rs in by_load.items():
        if rs.get("exact") and rs["exact"].refused:
            f[f"sim.paged_over_exact_refusals@{load:g}"] = rs["paged"].refused / rs["exact"].refused
    return f


def _model_stem(model: str) -> str:
    """A model's name for file names: a folder's or a config file's name, a preset as it is
    (`qwen2.5-0.5b-instruct` keeps its dots)."""
    name = Path(model).name
    return name.removesuffix(".json") if name.endswith(".json") else name
