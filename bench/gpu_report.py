"""The GPU suite's output: strict-JSON writing and ``results.md`` from ``results.json`` (torch-free).

Every section is rendered from whatever the parts recorded, also from partial results of a part that failed or
was stopped; a section that cannot be rendered says why instead of breaking the report.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

GOAL_REL_ERR = 0.10   # the estimator's goal against torch's allocated peak


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
    return lines + [""]


def vram_rows(r) -> list:
    """Per measured point: the estimate beside torch allocated/reserved and the device peak, with errors."""
    measured = _result(r, "vram_study").get("curves", [])
    estimated = {(c["name"], p["batch"]): p for c in _result(r, "vram_estimate").get("curves", [])
                 for p in c["points"]}
    rows = []
    for c in measured:
        for p in c["points"]:
            e = estimated.get((c["name"], p["batch"]), {}).get("peak_gib")

            def err(m, e=e):
                return e / m - 1 if isinstance(e, (int, float)) and isinstance(m, (int, float)) and m else None
            rows.append({"name": c["name"], "batch": p["batch"], "estimate": e, "allocated": p["peak_gib"],
                         "err_allocated": err(p["peak_gib"]), "reserved": p.get("reserved_gib"),
                         "err_reserved": err(p.get("reserved_gib")), "device": p.get("nvml_peak_gib"),
                         "err_device": err(p.get("nvml_peak_gib")), "device_source": p.get("device_peak_source"),
                         "phase": p.get("phase"), "step_s": p.get("step_seconds")})
    return rows


def _vram(r) -> list:
    if "vram_study" not in r["parts"] and "vram_estimate" not in r["parts"]:
        return []
    rows = vram_rows(r)
    lines = [f"## VRAM: `sdslim vram estimate` vs measured (goal |error| <= {GOAL_REL_ERR:.0%} vs torch allocated)",
             ""]
    if rows:
        lines += ["| setting | B | estimate GiB | torch allocated | err | reserved | err | device peak | err | phase |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
    else:
        lines.append("No point was measured (see the parts table).")
    for x in rows:
        lines.append(f"| {x['name']} | {x['batch']} | {_f(x['estimate'])} | {_f(x['allocated'])} | "
                     f"{_pct(x['err_allocated'])} | {_f(x['reserved'])} | {_pct(x['err_reserved'])} | "
                     f"{_f(x['device'])} | {_pct(x['err_device'])} | {x['phase']} |")
    errs = [x["err_allocated"] for x in rows if x["err_allocated"] is not None]
    if errs:
        ok = sum(abs(e) <= GOAL_REL_ERR for e in errs)
        worst = max(errs, key=abs)
        lines += ["", f"{ok} of {len(errs)} points within {GOAL_REL_ERR:.0%} of torch's allocated peak (worst "
                      f"{worst:+.1%}; mean {sum(errs) / len(errs):+.1%}). Device peak source: "
                      f"{', '.join(sorted({str(x['device_source']) for x in rows}))}."]
    for c in _result(r, "vram_study").get("curves", []):
        for note in c.get("notes", []):
            lines.append(f"- {c['name']}: {note}")
    est = _result(r, "vram_estimate")
    for name, err in (est.get("errors") or {}).items():
        lines.append(f"- estimate {name} failed: {err[:200]}")
    if est.get("device_mode"):
        lines.append(f"- estimator device mode: {est['device_mode']}")
    return lines + [""]


def _trainer(r) -> list:
    fams = [(n, _result(r, n)) for n in ("trainer_sd15", "trainer_sdxl") if n in r["parts"]]
    if not fams:
        return []
    lines = ["## Trainer on CUDA (`train_adapters`, random full-size teachers, the trainer's CUDA defaults)", "",
             "| | " + " | ".join(n.split("_")[1] for n, _ in fams) + " |", "|---|" + "---|" * len(fams),
             "| status | " + " | ".join(r["parts"][n]["status"] for n, _ in fams) + " |"]

    def row(label, fn):
        vals = []
        for _, t in fams:
            try:
                vals.append(fn(t) if t else "n/a")
            except (KeyError, TypeError, AttributeError):
                vals.append("n/a")
        lines.append(f"| {label} | " + " | ".join(str(v) for v in vals) + " |")
    row("sites (by kind)", lambda t: f"{t['sites']} ({', '.join(f'{k} {v}' for k, v in t['ranks_by_kind'].items())})")
    row("stage-2 groups", lambda t: t["effective"]["stage2_groups"])
    row("optimizer / bf16 autocast / grad ckpt", lambda t: f"{t['effective']['optimizer']} / "
        f"{t['effective']['bf16_autocast']} / {t['effective']['grad_ckpt']}")
    row("steps: stage 1 per site, stage 2", lambda t: f"{t['config']['stage1_steps']}, {t['config']['stage2_steps']}")
    row("finite: losses, adapters, UNet errors", lambda t: ", ".join(str(v) for v in t["finite"].values()))
    row("UNet error init → stage 1 → stage 2", lambda t: " → ".join(_f(t["unet_error"].get(k), "{:.3f}")
                                                                    for k in ("init", "stage1", "stage2")))
    row("loss stage 2 first → last", lambda t: f"{_f(t['loss']['stage2_first'], '{:.4f}')} → "
        f"{_f(t['loss']['stage2_last'], '{:.4f}')}")
    row("measured peak, torch allocated GiB", lambda t: _f(t["measured"]["peak_allocated_gib"]))
    row("predicted peak GiB (trainer)", lambda t: _f(t["predicted"]["peak_gib"]))
    row("prediction error", lambda t: _pct(t["rel_err"]))
    for seg, stage in (("calibration+init", "calibration"), ("stage1", "stage1"), ("stage2", "stage2")):
        row(f"{seg}: measured / predicted GiB",
            lambda t, seg=seg, stage=stage: f"{_f(t['measured']['segments_gib'].get(seg, {}).get('allocated'))} / "
            f"{_f((t['predicted']['stages_gib'] or {}).get(stage))}")
    row("device peak GiB (source)", lambda t: f"{_f(t['measured']['device_peak_gib'])} "
        f"({t['measured']['device_peak_source']})")
    row("wall time s", lambda t: _f(t["wall_s"], "{:.0f}"))
    return lines + [""]


def _speed(r) -> list:
    parts = [(n, _result(r, n)) for n in ("speed_sd15", "speed_sdxl") if n in r["parts"]]
    if not parts:
        return []
    lines = ["## Speed: UNet forward, fp16, sdpa, interleaved, median", ""]
    for name, s in parts:
        for key, shape in s.get("shapes", {}).items():
            lines += [f"**{s['family']} {key}** ({s['timer']}, median of {s['repeats']} after {s['warmup']} warm-up; "
                      f"fp8 output error vs fp16: " + ", ".join(f"{k} {v:.3f}" for k, v in shape["fp8_rel_err"].items())
                      + ")", "", "| model | median ms | min ms | speed-up | weights GiB |", "|---|---|---|---|---|"]
            for m, v in shape["models"].items():
                lines.append(f"| {m} | {v['median_ms']:.2f} | {v['min_ms']:.2f} | ×{v['speedup']:.2f} | "
                             f"{v['weight_gib']:.3f} |")
            lines.append("")
    f = _result(r, "fold")
    if f.get("command_s") is not None:
        lines.append(f"**Fold** (`sdslim slim --device {f['device']}`, random SD1.5 checkpoint "
                     f"{f['ckpt_gib']:.2f} GiB, {f['sites']} sites at ratio 0.5, {f['lora_tensors_merged']} LoCon "
                     f"tensors merged): {f['command_s']:.1f} s inside the command, {f['process_wall_s']:.1f} s with "
                     f"process start; slim file {f['slim_file_gib']:.2f} GiB.")
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
    for section in (_header, _environment, _vram, _trainer, _speed, _problems):
        try:
            out += section(results)
        except Exception as err:  # a report must never hide the results that made it
            out += [f"({section.__name__.strip('_')} section not rendered: {type(err).__name__}: {err})", ""]
    return "\n".join(out).rstrip() + "\n"
