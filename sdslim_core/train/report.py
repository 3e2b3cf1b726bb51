"""The training report: init table, per-site errors per stage, full-UNet errors, timings; text, dict and a PNG."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from .. import optional

TRAIN_META_VERSION = 1   # of the work dir's fingerprint and of the adapter file's sdslim.train metadata


@dataclasses.dataclass
class TrainReport:
    """What a run measured. Errors are relative (‖student − teacher‖ / ‖teacher‖) on held-out calibration data:
    per site on the site output, and for the whole UNet on its output (eps)."""
    family: str = ""
    ranks: dict = dataclasses.field(default_factory=dict)
    init_table: list = dataclasses.field(default_factory=list)     # rows: site, kind, width, rank, errors, chosen
    site_error: dict = dataclasses.field(default_factory=dict)     # stage → {site: error}
    unet_error: dict = dataclasses.field(default_factory=dict)     # stage → error
    steps: dict = dataclasses.field(default_factory=dict)
    timing: dict = dataclasses.field(default_factory=dict)
    vram: dict = dataclasses.field(default_factory=dict)
    params: dict = dataclasses.field(default_factory=dict)
    calibration: dict = dataclasses.field(default_factory=dict)
    budget: dict = dataclasses.field(default_factory=dict)
    plan: dict | None = None                                        # the cost plan printed before the run
    out: str = ""
    plot: str = ""
    work_dir: str = ""

    def to_dict(self) -> dict:
        return finite(dataclasses.asdict(self))

    def init_summary(self) -> dict:
        """Per method: mean error over sites and how many sites it won."""
        methods = []
        for row in self.init_table:
            for m in row["errors"]:
                if m not in methods:
                    methods.append(m)
        out = {}
        for m in methods:
            errs = [row["errors"][m] for row in self.init_table if m in row["errors"]]
            fin = [e for e in errs if math.isfinite(e)]
            out[m] = {"mean_error": sum(fin) / len(fin) if fin else math.inf,
                      "wins": sum(1 for row in self.init_table if row["chosen"] == m)}
        return out

    def text(self, max_rows: int = 200) -> str:
        lines = [f"sdslim train: {self.family}, {len(self.ranks)} sites slimmed"]
        if self.params:
            p = self.params
            lines.append(f"UNet parameters {p.get('original', 0) / 1e6:.1f}M → slim {p.get('slim', 0) / 1e6:.1f}M "
                         f"({p.get('slim', 0) / max(1, p.get('original', 1)):.2f}×); adapter parameters "
                         f"{p.get('adapters', 0) / 1e6:.1f}M (train time)")
        if self.init_table:
            methods = list(self.init_summary())
            head = f"{'site':<44} {'kind':<4} {'r/width':>10} " + " ".join(f"{m:>10}" for m in methods) + "  chosen"
            lines += ["", "initialisation: relative error per site on held-out data", head, "-" * len(head)]
            for row in self.init_table[:max_rows]:
                errs = " ".join(f"{row['errors'].get(m, math.nan):>10.4f}" for m in methods)
                lines.append(f"{row['site']:<44} {row['kind']:<4} {row['rank']:>4}/{row['width']:<5} {errs}  "
                             f"{row['chosen']}")
            summ = self.init_summary()
            lines.append(f"{'mean':<44} {'':<4} {'':>10} " +
                         " ".join(f"{summ[m]['mean_error']:>10.4f}" for m in methods))
            lines.append(f"{'sites won':<44} {'':<4} {'':>10} " +
                         " ".join(f"{summ[m]['wins']:>10d}" for m in methods))
        if self.site_error:
            stages = list(self.site_error)
            lines += ["", "per-site relative error by stage (held-out)",
                      f"{'site':<44} " + " ".join(f"{s:>10}" for s in stages)]
            for site in list(self.ranks)[:max_rows]:
                lines.append(f"{site:<44} " + " ".join(f"{self.site_error[s].get(site, math.nan):>10.4f}"
                                                        for s in stages))
            lines.append(f"{'mean':<44} " + " ".join(f"{_mean(self.site_error[s]):>10.4f}" for s in stages))
        if self.unet_error:
            lines += ["", "full-UNet relative eps error (all sites slim, held-out inputs): " +
                      ", ".join(f"{k} {v:.4f}" for k, v in self.unet_error.items())]
        if self.timing:
            t = self.timing
            parts = [f"{k.replace('_', ' ')} {v:.3g}" for k, v in t.items() if isinstance(v, (int, float))]
            lines.append("timing: " + ", ".join(parts))
        if self.vram:
            lines.append("VRAM: " + self.vram.get("text", ""))
        if self.out:
            lines.append(f"adapters: {self.out}")
        if self.plot:
            lines.append(f"plot: {self.plot}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def _mean(d: dict) -> float:
    vals = [v for v in d.values() if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def finite(obj):
    """``obj`` with every non-finite float replaced by None (JSON has no inf/nan)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def plot_site_errors(report: TrainReport, path) -> Path:
    """Per-site relative error per stage as grouped bars (matplotlib, Agg backend)."""
    matplotlib = optional.require("matplotlib", "the per-site error plot")
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    path = Path(path)
    sites = list(report.ranks)
    stages = list(report.site_error)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(sites) + 2), 4.2), dpi=110)
    width = 0.8 / max(1, len(stages))
    for j, stage in enumerate(stages):
        vals = [report.site_error[stage].get(s, math.nan) for s in sites]
        ax.bar([i + (j - (len(stages) - 1) / 2) * width for i in range(len(sites))], vals, width, label=stage)
    ax.set_xticks(range(len(sites)))
    ax.set_xticklabels([short_site(s) + f" r{report.ranks[s]}" for s in sites], rotation=90, fontsize=6)
    ax.set_ylabel("relative error (held-out)")
    title = f"sdslim train ({report.family}): per-site error"
    if report.unet_error:
        title += "; UNet eps error " + ", ".join(f"{k} {v:.3f}" for k, v in report.unet_error.items())
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path


def short_site(site: str) -> str:
    """A site name short enough for a plot label or a progress bar."""
    return (site.replace("input_blocks.", "in").replace("output_blocks.", "out").replace("middle_block.", "mid")
            .replace(".transformer_blocks.", ".tb").replace(".ff", ".ff"))


def train_metadata(report: TrainReport, session, site_err: dict, table: list) -> dict:
    """The ``sdslim.train`` metadata of the adapter file a run writes (JSON-safe)."""
    tc = session.tc
    return finite({
        "version": TRAIN_META_VERSION,
        "data": report.calibration,
        "steps": report.steps,
        "site_error": site_err,
        "site_error_init": report.site_error.get("init", {}),
        "site_error_stage1": report.site_error.get("stage1", {}),
        "unet_error": report.unet_error,
        "init_method": {row["site"]: row["chosen"] for row in table},
        "ranks": {"ratio": tc.ratio, "ff_ratio": tc.ff_ratio, "ff_rank": tc.ff_rank, "res_ratio": tc.res_ratio,
                  "budget": tc.budget, **({"budget_info": report.budget} if report.budget else {})},
        "config": tc.run_fields(),
        "optimizer": session.optimizer_name,
        "device": str(session.device),
        "processes": session.topo.world,
    })
