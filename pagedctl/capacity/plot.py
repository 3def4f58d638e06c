"""Section 6, `--plot`: PNG charts of sections 2 and 4 (matplotlib, an optional extra)."""

from __future__ import annotations

from pathlib import Path


def write_plots(out_dir: Path, stem: str, run) -> list[Path]:
    """Capacity against sequence length; refusals against load. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = run.cap_rows
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["seq_len"] for r in rows]
    ax.plot(xs, [r["paged"] for r in rows], "o-", label="paged pool")
    ax.plot(xs, [r["contiguous_same_budget"] for r in rows], "s--", label="contiguous, same budget")
    if rows[0]["contiguous_whole_card"] is not None:
        ax.plot(
            xs, [r["contiguous_whole_card"] for r in rows], "^:", label="contiguous, whole card"
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("sequences that fit")
    ax.set_title(f"{run.fp.name}: capacity vs sequence length")
    ax.grid(True, which="both", alpha=0.3)
    written.append(_save(plt, fig, ax, out_dir / f"{stem}-capacity.png"))
    results = getattr(run, "sim_results", [])
    if results:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in dict.fromkeys(r.allocator for r in results):
            mine = [r for r in results if r.allocator == name]
            ax.plot([r.load for r in mine], [100 * r.refusal_rate for r in mine], "o-", label=name)
        ax.set_xlabel("load (offered token-time / pool)")
        ax.set_ylabel("requests refused (%)")
        ax.set_title("refusals vs load, same arrivals")
        ax.grid(True, alpha=0.3)
        written.append(_save(plt, fig, ax, out_dir / f"{stem}-refusals.png"))
    return written


def _save(plt, fig, ax, path: Path) -> Path:
    """Legend, layout, a PNG at `path`, and the figure closed."""
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
