"""The GPU suite's output: strict-JSON writing and ``results.md`` from ``results.json`` (torch-free).

Every section is rendered from whatever the parts recorded, also from partial results of a part that failed or
was stopped; a section that cannot be rendered says why instead of breaking the report.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from sdslim_core.vram.allocator import DEFAULT_CONTEXT_GIB   # torch-free

GOAL_REL_ERR = 0.10   # the estimator's goal (device peak vs NVML; allocated vs torch's)
GIB = 2 ** 30


def finite(obj):
    """JSON-safe copy: non-finite floats become the strings "nan"/"inf"/"-inf" (strict JSON has no NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json(path, obj):
    """Write ``obj`` as strict JSON, atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(finite(obj), indent=1))
    os.replace(tmp, path)


def _f(v, fmt="{:.2f}", none="n/a"):
    return none if not isinstance(v, (int, float)) or isinstance(v, bool) else fmt.format(v)


def _pct(v):
    return _f(v, "{:+.1%}")


def _result(results, name):
    rec = results["parts"].get(name) or {}
    return rec.get("result") or {}


# -------------------------------------------------------------------------------------------- sections

def _header(r) -> list:
    env = _result(r, "environment")
    gpu = (env.get("gpu") or {}).get("name") or ("CPU (dry run)" if r["mode"] == "dry-run" else "no GPU seen")
    lines = [f"# sdslim GPU suite: {gpu}", ""]
    if r["mode"] == "dry-run":
        lines += ["**Dry run**: the same code on the CPU with tiny UNets. The numbers check the plumbing, not "
                  "the GPU; they are not results.", ""]
    lines += [f"Started {r['started_at']}, wall time {_f(r.get('wall_s'), '{:.0f}')} s of a {r['budget_s']:.0f} s "
              f"budget{'' if r.get('finished') else ' (still running or stopped early)'}; commit "
              f"{env.get('git_commit') or 'n/a'}; command `{r['command']}`.", "",
              "| part | status | time | cap | note |", "|---|---|---|---|---|"]
    for p in r["plan"]:
        rec = r["parts"][p["name"]]
        note = rec.get("error") or "; ".join((rec.get("result") or {}).get("skipped", []))
        lines.append(f"| {p['name']} | {rec['status']} | {_f(rec.get('seconds'), '{:.0f} s', '')} | "
                     f"{_f(rec.get('cap_s', p['cap_s']), '{:.0f} s')} | {note[:160]} |")
    return lines + [""]


def _environment(r) -> list:
    env = _result(r, "environment")
    if not env:
        return []
    pk = env.get("packages", {})
    lines = ["## Environment", ""]
    gpu = env.get("gpu")
    if gpu:
        lines.append(f"- GPU: {gpu['name']}, {gpu['total_gib']:.1f} GiB, compute capability {gpu['capability']}, "
                     f"{gpu['multiprocessors']} SMs; driver {gpu.get('driver') or 'n/a'}; cuDNN {gpu.get('cudnn')}; "
                     f"bf16 {'yes' if gpu.get('bf16') else 'no'}; sdpa backends "
                     f"{', '.join(k for k, v in gpu.get('sdpa', {}).items() if v)}")
    lines.append(f"- torch {env['torch']} (CUDA {env.get('torch_cuda') or 'none'}), Python {env['python']}, "
                 f"{env['cpu_count']} CPUs, {env['platform']}")
    lines.append("- " + ", ".join(f"{k} {v}" if v else f"{k} **not importable**" for k, v in pk.items()))
    for k, why in env.get("not_importable", {}).items():
        if k in ("bitsandbytes", "xformers"):
            lines.append(f"  - {k}: {why}")
    c = env.get("context") or {}
    if c.get("context_gib") is not None:
        lines.append(f"- CUDA context (NVML − torch reserved after a tiny train + sample step): {c['context_gib']:.2f} GiB "
                     f"(NVML before this process: {_f(c.get('before_gib'))} GiB)")
    return lines + [""]


def context_gib(r):
    """(context GiB, where from): the environment part's measurement, else the estimator's named default."""
    from_env = (_result(r, "environment").get("context") or {}).get("context_gib")
    if isinstance(from_env, (int, float)):
        return from_env, "measured by the environment part"
    return DEFAULT_CONTEXT_GIB, "the estimator's default (not measured in this run)"


def _err(e, m):
    return e / m - 1 if isinstance(e, (int, float)) and isinstance(m, (int, float)) and m else None


def vram_rows(r) -> list:
    """Per measured seed-study point: the estimate beside torch's allocated peak, the allocator model beside torch's
    reserved peak, and the predicted device peak (model reserve + context) beside NVML's reading."""
    measured = _result(r, "seed_study").get("curves", [])
    estimated = {(c["name"], p["batch"]): p for c in _result(r, "vram_estimate").get("curves", [])
                 for p in c["points"]}
    context, _ = context_gib(r)
    rows = []
    for c in measured:
        for p in c["points"]:
            e = estimated.get((c["name"], p["batch"]), {})
            est, est_res = e.get("peak_gib"), e.get("reserved_gib")
            device = p.get("nvml_end_gib")
            est_dev = est_res + context if isinstance(est_res, (int, float)) else None
            rows.append({"name": c["name"], "batch": p["batch"], "estimate": est, "allocated": p["peak_gib"],
                         "err_allocated": _err(est, p["peak_gib"]), "reserved": p.get("reserved_gib"),
                         "model_reserved": est_res, "err_reserved": _err(est_res, p.get("reserved_gib")),
                         "device": device, "predicted_device": est_dev, "err_device": _err(est_dev, device),
                         "err_device_allocated_only": _err(est, device),
                         "device_polled": p.get("nvml_peak_gib"), "point_context": p.get("context_gib"),
                         "phase": p.get("phase"), "step_s": p.get("step_seconds")})
    return rows


def _summary(errs, label):
    errs = [e for e in errs if e is not None]
    if not errs:
        return f"{label}: no point"
    ok = sum(abs(e) <= GOAL_REL_ERR for e in errs)
    worst = max(errs, key=abs)
    return (f"{label}: {ok} of {len(errs)} within {GOAL_REL_ERR:.0%} (worst {worst:+.1%}, mean "
            f"{sum(errs) / len(errs):+.1%})")


def vram_section(r) -> list:
    """The training-VRAM section: every measured seed-study point beside its estimate, and the conclusions."""
    if "seed_study" not in r["parts"] and "vram_estimate" not in r["parts"]:
        return []
    rows = vram_rows(r)
    context, source = context_gib(r)
    lines = ["## Training VRAM: the seed's study measured vs `sdslim vram estimate`", "",
             f"Device peak predicted = the allocator model's reserve + the CUDA context {context:.2f} GiB ({source}); "
             "measured = NVML's whole-device reading at the end of each point (the reserve only grows within a "
             "point). Goal: |error| ≤ 10 % on the device peak, next to torch's allocated peak.", ""]
    if rows:
        lines += ["| setting | B | allocated | estimate | err | reserved | model | err | device (NVML) | predicted | "
                  "err | NVML−reserved | phase | s/step |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    else:
        lines.append("No point was measured (see the parts table).")
    for x in rows:
        lines.append(f"| {x['name']} | {x['batch']} | {_f(x['allocated'])} | {_f(x['estimate'])} | "
                     f"{_pct(x['err_allocated'])} | {_f(x['reserved'])} | {_f(x['model_reserved'])} | "
                     f"{_pct(x['err_reserved'])} | {_f(x['device'])} | {_f(x['predicted_device'])} | "
                     f"{_pct(x['err_device'])} | {_f(x['point_context'])} | {x['phase']} | {_f(x['step_s'])} |")
    if rows:
        lines += ["", "- " + _summary([x["err_allocated"] for x in rows], "estimate vs torch allocated"),
                  "- " + _summary([x["err_reserved"] for x in rows], "allocator model vs torch reserved"),
                  "- " + _summary([x["err_device"] for x in rows], "predicted vs NVML device peak"),
                  "- " + _summary([x["err_device_allocated_only"] for x in rows],
                                  "for comparison, the bare estimate vs NVML")]
    for c in _result(r, "seed_study").get("curves", []):
        for note in c.get("notes", []):
            lines.append(f"- {c['name']}: {note}")
    est = _result(r, "vram_estimate")
    for name, err in (est.get("errors") or {}).items():
        lines.append(f"- estimate {name} failed: {err[:200]}")
    if est.get("not_run"):
        lines.append(f"- not estimated (the part's cap): {', '.join(est['not_run'])}")
    if est.get("gpu"):
        lines.append(f"- estimator processes: {est['gpu']}; device mode {est.get('device_mode')}")
    lines += [""] + _conclusions(r)
    return lines + [""]


def _conclusions(r) -> list:
    """The seed's constant / slope / order classification of every setting against its baseline, from the measured
    curves and from the estimated ones (``vram.fit.classify``), side by side."""
    try:
        from sdslim_core.vram.fit import classify, fit_curve
    except ImportError:
        return []
    measured = {c["name"]: c for c in _result(r, "seed_study").get("curves", []) if len(c["points"]) > 1}
    estimated = {c["name"]: c for c in _result(r, "vram_estimate").get("curves", [])}
    lines = ["**The seed's conclusions, measured vs estimated** (fit `max(plateau, a + b·B)` of the points, each "
             "setting against its baseline):", "", "| setting | vs | measured: fit | measured effect | "
             "estimated effect (same B) |", "|---|---|---|---|---|"]
    n = 0
    for name, c in measured.items():
        base = measured.get(c.get("baseline"))
        if base is None or base is c:
            continue
        fm, fb = fit_curve(c["points"]), fit_curve(base["points"])
        batches = {p["batch"] for p in c["points"]}
        est_c, est_b = estimated.get(name), estimated.get(c.get("baseline"))
        est = "n/a"
        if est_c and est_b:
            pe = [p for p in est_c["points"] if p["batch"] in batches]
            pb = [p for p in est_b["points"] if p["batch"] in {p["batch"] for p in base["points"]}]
            if len(pe) > 1 and len(pb) > 1:
                est = classify(fit_curve(pb), fit_curve(pe))
        lines.append(f"| {name} | {c['baseline']} | {fm.intercept_gib:.2f} + {fm.slope_gib:.3f}·B, plateau "
                     f"{fm.plateau_gib:.2f} | {classify(fb, fm)} | {est} |")
        n += 1
    return lines + [""] if n else []


def _trainer(r) -> list:
    fams = [(n, _result(r, n)) for n in ("trainer_sd15", "trainer_sdxl") if n in r["parts"]]
    if not fams:
        return []
    lines = ["## Trainer on CUDA (`train_adapters`, random full-size teachers, under an 8 GiB device limit)", "",
             "| | " + " | ".join(n.split("_")[1] for n, _ in fams) + " |", "|---|" + "---|" * len(fams),
             "| status | " + " | ".join(r["parts"][n]["status"] for n, _ in fams) + " |"]

    def row(label, fn):
        vals = []
        for _, t in fams:
            try:
                vals.append(fn(t) if t else "n/a")
            except (KeyError, TypeError, AttributeError, ValueError):
                vals.append("n/a")
        lines.append(f"| {label} | " + " | ".join(str(v) for v in vals) + " |")
    row("plan on this GPU: quick / full recipe", lambda t: " / ".join(_dur(t["plan"]["eta_s"][k])
                                                                      for k in ("quick", "full")))
    row("8 GB check (the plan's)", lambda t: t["fit_8gb"]["text"])
    row("run: sites, stage-2 groups, teacher", lambda t: f"{t['run']['sites']}, {t['run']['stage2_groups']}, "
        + ("offloaded" if t["run"].get("offload_teacher") else "on the device"))
    row("run: device / torch limit GiB", lambda t: f"{_f(t['run'].get('device_gib', 8.0))} / "
        f"{_f(t['run']['limit_gib'])}")
    for ph in ("setup", "calibration", "capture", "rank curves", "init", "stage1", "stage2"):
        row(f"{ph}: allocated / reserved / device GiB",
            lambda t, ph=ph: f"{_f(t['run']['phases_gib'][ph]['allocated'])} / "
            f"{_f(t['run']['phases_gib'][ph]['reserved'])} / {_f(t['run']['device_derived_gib'][ph])}")
    def run_fit(t):         # the check of the placement the run used
        return t["fit_8gb"]["offloaded"] if t["run"].get("offload_teacher") else t["fit_8gb"]
    row("predicted device GiB: calibration / stage 1 / stage 2",
        lambda t: f"{_f(run_fit(t)['calibration_gib'])} / {_f(run_fit(t)['stage1_gib'])} / "
        f"{_f(run_fit(t)['stage2_gib_by_groups'][str(t['run']['stage2_groups'])])}")
    row("fits that device (measured)", lambda t: t["run"].get("fits_device", t["run"].get("fits_8gb")))
    row("offloaded teacher: forward b8 / stage-2 step, s (× on the device)",
        lambda t: f"{_f(t['offload_cost']['offloaded']['forward_batch8_s'], '{:.3f}')} / "
        f"{_f(t['offload_cost']['offloaded']['stage2_step_s'], '{:.3f}')} "
        f"(×{_f(t['offload_cost']['ratio']['forward_batch8_s'])} / ×{_f(t['offload_cost']['ratio']['stage2_step_s'])})")
    row("steps/s stage 1 / stage 2", lambda t: f"{_f(t['run']['steps_per_s'].get('stage1'))} / "
        f"{_f(t['run']['steps_per_s'].get('stage2'))}")
    row("s/step plan vs measured: stage 1, stage 2",
        lambda t: "; ".join(f"{_f(a, '{:.3f}')} vs {_f(b, '{:.3f}')}" for a, b in t["run"]["plan_vs_measured"].values()))
    row("UNet error init → stage 1 → stage 2", lambda t: " → ".join(_f(t["run"]["unet_error"].get(k), "{:.3f}")
                                                                    for k in ("init", "stage1", "stage2")))
    row("adapters finite", lambda t: t["run"]["finite_adapters"])
    row("run wall s", lambda t: _f(t["run"]["wall_s"], "{:.0f}"))
    return lines + [""]


def _dur(s):
    if not isinstance(s, (int, float)) or s != s:
        return "n/a"
    return f"{s:.0f} s" if s < 90 else (f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h")


def _speed(r) -> list:
    parts = [(n, _result(r, n)) for n in ("speed_sd15", "speed_sdxl") if n in r["parts"]]
    if not parts:
        return []
    lines = ["## Speed: UNet forward, fp16, sdpa; eager and CUDA-graph replay (medians, interleaved)", ""]
    for name, s in parts:
        if s.get("notes"):
            lines.append(f"- {s.get('family')}: " + "; ".join(f"{k}: {v}" for k, v in s["notes"].items()))
        for key, shape in s.get("shapes", {}).items():
            if "skipped" in shape:
                lines += [f"**{s['family']} {key}**: skipped ({shape['skipped']})", ""]
                continue
            lines += [f"**{s['family']} {key}** ({s['timer']}; eager {s['eager_repeats']} rounds, graph "
                      f"{s['graph_replays']} replays)", "",
                      "| model | eager ms | ×eager | graph ms | ×graph | FLOPs × | ideal × | of ideal | weights GiB |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for m, v in shape["models"].items():
                lines.append(f"| {m} | {v['eager_ms']:.2f} | ×{v['eager_speedup']:.2f} | {v['graph_ms']:.2f} | "
                             f"×{v['graph_speedup']:.2f} | {v['flops_ratio']:.3f} | ×{v['ideal_speedup']:.2f} | "
                             f"{v['of_ideal']:.0%} | {s['weight_gib'][m]:.3f} |")
            lines.append("")
        if s.get("fp8_rel_err"):
            lines += ["fp8 output error vs fp16: " + ", ".join(f"{k} {v:.3f}" for k, v in s["fp8_rel_err"].items()), ""]
    p = _result(r, "profile")
    if p.get("models"):
        kinds = ("GEMM/conv", "attention", "norm", "elementwise")
        lines += [f"**Where the time goes** (torch.profiler, SD1.5 {p['shape']}, {p['time']}, ms per forward; "
                  "site = inside a slimmed site's module)", "",
                  "| model | " + " | ".join(f"site {k}" for k in kinds) + " | " + " | ".join(f"other {k}" for k in kinds)
                  + " | total | × | ideal × |", "|---|" + "---|" * (2 * len(kinds) + 3)]
        for m, v in p["models"].items():
            cells = [_f(v["ms"]["site"].get(k, 0.0), "{:.2f}") for k in kinds] + \
                    [_f(v["ms"]["other"].get(k, 0.0), "{:.2f}") for k in kinds]
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {v['total_ms']:.2f} | ×{v['speedup']:.2f} | "
                         f"×{v['ideal_speedup']:.2f} |")
        lines.append("")
    c = _result(r, "speed_compile")
    if c.get("models"):
        lines += ["**torch.compile** (SD1.5 512² B=1; compile " + ", ".join(f"{k} {v:.0f} s" for k, v in
                                                                          c["compile_s"].items()) + ")", "",
                  "| model | median ms | vs compiled original |", "|---|---|---|"]
        lines += [f"| {k} | {v['median_ms']:.2f} | ×{v['speedup_vs_compiled_original']:.2f} |"
                  for k, v in c["models"].items()]
        lines.append("")
    return lines


def _sampling(r) -> list:
    s = _result(r, "sampling_vram")
    if not s.get("families"):
        return []
    est = {c["name"]: c for c in _result(r, "vram_estimate").get("curves", [])}
    context, source = context_gib(r)
    lines = ["## Sampling VRAM (device peak as NVML shows it)", "",
             f"Includes: {s['includes']}. Predicted = the estimator's reserve (its GGUF rows kept quantised, as "
             f"ComfyUI-GGUF runs them) + context {context:.2f} GiB ({source}).", ""]
    lo = s.get("loader") or {}
    if lo.get("error"):
        lines += [f"sdslim's own GGUF loader: not checked ({lo['error']})", ""]
    elif lo:
        lines += [f"sdslim's own GGUF loader (`load_gguf_unet`, a Q8_0 file read back): parameters "
                  f"{', '.join(lo['param_dtypes'])}, {lo['held_bytes']:,} B held for {lo['file_bytes']:,} B on disk "
                  f"({'kept quantised' if lo['kept_quantised'] else 'dequantised at load: it holds the fp16 row'}'s "
                  "bytes)", ""]
    for fam, f in s["families"].items():
        vae = f.get("vae_decode", {})
        lines += [f"**{fam} {f['px']} px** (VAE decode alone: {_f(vae.get('reserved_gib'))} GiB reserved; text "
                  f"encoders' fp16 weights {f['text_encoders_fp16_gib']:.2f} GiB, not included)", "",
                  "| UNet | weights GiB | allocated | reserved | device (NVML) | derived | predicted | err | "
                  "with VAE decode | fits 8 GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, row in f["rows"].items():
            if "skipped" in row:
                lines.append(f"| {name} | skipped: {row['skipped']} |||||||||")
                continue
            e = est.get(f"sampling {fam} {name}")
            pred = e["points"][0]["reserved_gib"] + context if e else None
            dev = row.get("nvml_end_gib")
            with_vae = row.get("with_vae_decode_derived_gib")
            fits = "n/a" if with_vae is None else ("yes" if with_vae <= 8 else "no")
            lines.append(f"| {name} | {row['weight_bytes'] / GIB:.2f} | {_f(row.get('allocated_gib'))} | "
                         f"{_f(row.get('reserved_gib'))} | {_f(dev)} | {_f(row.get('device_derived_gib'))} | "
                         f"{_f(pred)} | {_pct(_err(pred, dev))} | {_f(with_vae)} | {fits} |")
        lines.append("")
    return lines


def _problems(r) -> list:
    bad = [(n, rec) for n, rec in r["parts"].items() if rec["status"] not in ("ok", "pending", "running")]
    if not bad:
        return []
    lines = ["## Problems", ""]
    for n, rec in bad:
        lines.append(f"- **{n}**: {rec['status']}: {rec.get('error', '')}")
        tail = rec.get("log_tail") or []
        if tail:
            lines += ["", "```", *tail[-12:], "```", ""]
    return lines


def markdown(results: dict) -> str:
    out = []
    for section in (_header, _environment, _trainer, _speed, _sampling, vram_section, _problems):
        try:
            out += section(results)
        except Exception as err:  # a report must never hide the results that made it
            out += [f"({section.__name__.strip('_')} section not rendered: {type(err).__name__}: {err})", ""]
    return "\n".join(out).rstrip() + "\n"
