"""PNG charts of a sweep's document (`--plot`, needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

from pagedctl.sweep.metrics import METRICS
from pagedctl.sweep.settings import SHORT, show_value


def write_plots(doc: dict, out: Path, stem: str) -> list[Path]:
    """Per batch experiment: the primary metric (median, min-max bars) and preemptions against
    the first varying setting, one line per combination of the others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for exp in doc["experiments"]:
        ok = [p for p in exp["points"] if p["status"] == "ok"]
        if exp["mode"] != "batch" or len(ok) < 2:
            continue
        varying = exp["varying"] or [["point", "label"]]
        (xs_sec, xs_key), rest = varying[0], varying[1:]

        def value(p: dict, section: str, key: str) -> str:
            return p["label"] if section == "point" else show_value(p[section].get(key))

        xs = list(dict.fromkeys(value(p, xs_sec, xs_key) for p in exp["points"]))
        series: dict[str, list[dict]] = {}
        for p in ok:
            name = " ".join(f"{SHORT.get(k, k)}={value(p, s, k)}" for s, k in rest)
            series.setdefault(name, []).append(p)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for name, ps in series.items():
            pos = [xs.index(value(p, xs_sec, xs_key)) for p in ps]
            scale = METRICS[exp["primary"]].scale  # as the table shows it (bytes in MiB)
            s = [{k: v * scale for k, v in p["summary"][exp["primary"]].items()} for p in ps]
            med = [v["median"] for v in s]
            low = [m - v["min"] for m, v in zip(med, s, strict=True)]
            high = [v["max"] - m for m, v in zip(med, s, strict=True)]
            err = [low, high]
            ax1.errorbar(pos, med, yerr=err, marker="o", capsize=3, label=name or None)
            pre = [p["summary"]["preemptions"]["median"] for p in ps]
            ax2.plot(pos, pre, marker="o", label=name or None)
        metric = METRICS[exp["primary"]].header
        for ax, title in ((ax1, metric), (ax2, "preemptions")):
            ax.set_xticks(range(len(xs)), xs)
            ax.set_xlabel(SHORT.get(xs_key, xs_key))
            ax.set_title(title)
            ax.grid(alpha=0.3)
            if any(series):
                ax.legend(fontsize=7)
        fig.suptitle(f"{doc['sweep']}: {exp['title']}")
        fig.tight_layout()
        path = out / f"{stem}-{exp['name']}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
