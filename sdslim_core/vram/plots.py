"""VRAM-vs-batch-size plots (matplotlib, Agg): one line per setting, one panel per group.

Curves are dicts with ``name``, ``group`` and ``points`` ([{batch, peak_gib}]), as the estimator and
the study write them; ``overlay`` curves (e.g. estimates over measurements) are drawn dashed in the
same colour as the curve of the same name.
"""
from .. import optional


def figure_curves(curves, title, overlay=(), overlay_label="estimate", ylabel="peak VRAM (GiB)", limit=None,
                  size=None):
    """The plot as a ``matplotlib.figure.Figure`` (no pyplot state). ``limit``: (GiB, label) drawn as a
    horizontal red line in every panel, e.g. the GPU's memory."""
    optional.require("matplotlib", "the VRAM plot")
    from matplotlib.figure import Figure

    groups = list(dict.fromkeys(c.get("group", "") for c in curves))
    fig = Figure(figsize=size or (6.0 * len(groups), 4.4))
    axes = fig.subplots(1, len(groups), squeeze=False)
    over = {c["name"]: c for c in overlay}
    for ax, group in zip(axes[0], groups):
        for i, c in enumerate(x for x in curves if x.get("group", "") == group):
            pts = [p for p in c["points"] if p.get("peak_gib") is not None]
            color = f"C{i % 10}"
            ax.plot([p["batch"] for p in pts], [p["peak_gib"] for p in pts], "o-", color=color, ms=3.5, lw=1.4,
                    label=c["name"])
            if c["name"] in over:
                opts = over[c["name"]]["points"]
                ax.plot([p["batch"] for p in opts], [p["peak_gib"] for p in opts], "x--", color=color, lw=1.0, ms=4)
        if limit is not None:
            ax.axhline(limit[0], color="tab:red", lw=1.2, ls="-", label=limit[1])
        if group or len(groups) > 1:
            ax.set_title(group, fontsize=10)
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    if over:
        axes[0][0].plot([], [], "kx--", lw=1.0, ms=4, label=overlay_label)
        axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def plot_curves(curves, path, title, overlay=(), overlay_label="estimate", ylabel="peak VRAM (GiB)"):
    figure_curves(curves, title, overlay, overlay_label, ylabel).savefig(path, dpi=90)
    return path
