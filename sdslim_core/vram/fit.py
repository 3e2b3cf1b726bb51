"""Curve fits shared by the study and the estimator (torch-free).

A training curve is ``peak(B) = max(plateau, intercept + slope·B)``: the forward/backward peak is
linear in the batch size B (activations are per sample), the optimizer-step peak (weights + grads +
states + the step's temporaries) does not depend on B. Each point carries ``line_gib`` (the peak
outside the optimizer step) and ``plateau_gib`` (the optimizer step's peak, None for sampling).
"""
import math
from dataclasses import asdict, dataclass

# classification thresholds, relative to the baseline curve
CONSTANT_TOL = 0.02  # of the baseline's largest constant (intercept or plateau)
SLOPE_TOL = 0.03
ORDER_RATIO = 1 / 3


@dataclass
class CurveFit:
    intercept_gib: float
    slope_gib: float  # GiB per sample
    plateau_gib: float  # optimizer-step peak (max over B); 0 when there is none
    kink_batch: float | None  # B below which the plateau is the peak (0: never; None: for every B)
    max_residual_gib: float  # of the linear fit of the forward/backward peaks

    def to_dict(self) -> dict:
        return asdict(self)

    def predict(self, batch: float) -> float:
        return max(self.plateau_gib, self.intercept_gib + self.slope_gib * batch)


def fit_line(xs, ys):
    """Least-squares intercept, slope and max |residual|; a single point gives slope 0."""
    n = len(xs)
    if n == 0:
        raise ValueError("no points to fit")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    return intercept, slope, max(abs(y - intercept - slope * x) for x, y in zip(xs, ys))


def fit_curve(points) -> CurveFit:
    """Fit ``max(plateau, a + b·B)`` to points with ``batch``, ``line_gib`` and ``plateau_gib``."""
    pts = [p for p in points if p.get("line_gib") is not None]
    a, b, resid = fit_line([p["batch"] for p in pts], [p["line_gib"] for p in pts])
    plateau = max((p["plateau_gib"] or 0.0 for p in pts), default=0.0)
    if plateau <= a + b:
        kink = 0.0
    else:
        kink = (plateau - a) / b if b > 0 else None
    return CurveFit(a, b, plateau, kink, resid)


def largest_batch(fit: CurveFit, budget_gib: float) -> int | None:
    """The largest batch size B >= 1 with ``fit.predict(B) <= budget_gib``: 0 when not even B=1 fits, None when
    every B fits (a flat fit)."""
    if fit.predict(1) > budget_gib:
        return 0
    if fit.slope_gib <= 0:
        return None
    b = math.floor((budget_gib - fit.intercept_gib) / fit.slope_gib)
    while b > 1 and fit.predict(b) > budget_gib:  # float rounding at the boundary
        b -= 1
    return max(b, 1)


def classify(base: CurveFit, fit: CurveFit) -> str:
    """How a setting changes the curve vs the baseline, in the seed's terms: the constant (intercept),
    the slope (per-sample activations), or the order (activations recomputed: slope < 1/3 of the
    baseline's, the curve stays flat for a long range of B)."""
    effects = []
    tol = CONSTANT_TOL * max(base.intercept_gib, base.plateau_gib)
    d_const = fit.intercept_gib - base.intercept_gib
    if abs(d_const) > tol:
        effects.append(f"{'lowers' if d_const < 0 else 'raises'} the constant ({d_const:+.2f} GiB)")
    if base.slope_gib > 0 and fit.slope_gib < ORDER_RATIO * base.slope_gib:
        effects.append(f"lowers the order (slope {fit.slope_gib:.2f} vs {base.slope_gib:.2f} GiB/sample)")
    elif base.slope_gib > 0 and abs(fit.slope_gib / base.slope_gib - 1) > SLOPE_TOL:
        verb = "lowers" if fit.slope_gib < base.slope_gib else "raises"
        effects.append(f"{verb} the slope ({fit.slope_gib / base.slope_gib - 1:+.0%})")
    d_plateau = fit.plateau_gib - base.plateau_gib
    if abs(d_plateau) > tol and not effects:
        effects.append(f"{'lowers' if d_plateau < 0 else 'raises'} only the optimizer-step plateau "
                       f"({d_plateau:+.2f} GiB)")
    return "; ".join(effects) or "no change"


def kink_note(fit: CurveFit) -> str:
    """Why small batch sizes sit above/on a flat line (the seed's 'B=1→2 barely changes')."""
    if fit.kink_batch is not None and fit.kink_batch <= 1:
        return "linear from B=1 (the optimizer step is never the peak)"
    upto = "every B" if fit.kink_batch is None else f"B < {fit.kink_batch:.1f}"
    return (f"flat at {fit.plateau_gib:.2f} GiB for {upto}: there the optimizer step (weights + grads + "
            f"states + its temporaries, e.g. foreach AdamW's fp32 copy) is the peak, not the activations "
            f"({fit.intercept_gib:.2f} + {fit.slope_gib:.3f}·B)")


def fit_table(curves) -> str:
    """Markdown table: one row per curve with its fit and classification vs its baseline.

    ``curves``: dicts with ``name``, ``baseline`` and ``points`` (as the estimator/study write them)."""
    fits = {c["name"]: fit_curve(c["points"]) for c in curves}
    rows = ["| setting | intercept GiB | slope GiB/sample | opt-step plateau GiB | flat for | vs baseline | effect |",
            "|---|---|---|---|---|---|---|"]
    for c in curves:
        f = fits[c["name"]]
        base = c.get("baseline") or c["name"]
        effect = classify(fits[base], f) if base in fits and base != c["name"] else "(baseline)"
        flat = "every B" if f.kink_batch is None else ("-" if f.kink_batch <= 1 else f"B < {f.kink_batch:.1f}")
        rows.append(f"| {c['name']} | {f.intercept_gib:.2f} | {f.slope_gib:.3f} | {f.plateau_gib:.2f} | {flat} | "
                    f"{base if base != c['name'] else '-'} | {effect} |")
    return "\n".join(rows)
