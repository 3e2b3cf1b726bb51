"""What the default training recipe costs at real size, and how well the printed plan predicts a run.

    .venv/bin/python bench/real_size.py [--families sd15,sdxl] [--teachers tiny,wide] [--out out/real_size]
        [--cache DIR] [--threads 2] [--plan-only] [--no-default-plan] [--short-latent N]
        [--teacher-settings demo,reduced]

Real shapes (``--families``): a random-weight full-size checkpoint (tools/random_checkpoint.py: the real UNet and
text encoders) on the CPU. (1) Two prompts through the checkpoint's own text encoders. (2) The cost plan of the
*default* recipe (``sdslim train --ckpt … --prompt …``, every setting at its default) with its warm-up measured on
this machine: UNet forwards/backwards and seconds per phase, work-folder bytes, the rank allocation's share.
(3) A short run of the real phases on four sites (the first and the deepest FeedForward and ResBlock) with a few
units of each phase (2 trajectories of 2 steps, 3 stage-1 steps per site, 2 stage-2 steps; act_select init: OBS's
cost is in the plan): seconds per unit
(trajectory of the default 20 steps, captured input, rank-curve site, stage-1 step, stage-2 step), RAM peak and
work-folder bytes, next to what the plan predicted for that short run. (4) ``sdslim slim`` with those adapters and
``sdslim eval --prompt`` (1 seed, 2 steps): the whole path prompts → adapters → slim model → comparison.
Tiny/wide teachers (``--teachers``), at each of ``--teacher-settings``: ``demo``, the demo's budget at ratio 0.5
(16 prompts), and ``reduced``, the suite's short run (two prompts, uniform 0.5, 8 trajectories of 8 steps, 40 steps
per stage: tests/test_real_path.py checks its work folder, this measures its ETA): the printed ETAs (before the
run, and after the rank allocation where ranks are allocated) and the planned work folder against the measured
run. ``--plan-only``: (1) and (2) only, for each family.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import torch  # noqa: E402

import random_checkpoint  # noqa: E402
from sdslim_core import layout, tiny  # noqa: E402
from sdslim_core.apps.demo import FULL  # noqa: E402
from sdslim_core.apps.evaluate import evaluate  # noqa: E402
from sdslim_core.apps.slim import slim_checkpoint  # noqa: E402
from sdslim_core.modules.unet import open_checkpoint  # noqa: E402
from sdslim_core.text.conditioning import PromptEncoder  # noqa: E402
from sdslim_core.tiny import data as tiny_data  # noqa: E402
from sdslim_core.train import Calibration, TrainConfig  # noqa: E402
from sdslim_core.train.plan import Plan, _phases, _stage2_inputs, bank_size, make_plan  # noqa: E402
from sdslim_core.train.run import execute, train_adapters  # noqa: E402
from sdslim_core.train.session import Session  # noqa: E402
from sdslim_core.train.teacher import teacher_weights  # noqa: E402

PROMPTS = ["a photo of a cat sitting on a windowsill, soft light", "a red sports car on a wet road at night"]
SHORT = dict(n_trajectories=2, sample_steps=2, stage1_steps=3, stage2_steps=2, checkpoint_every=10 ** 6,
             init_methods=("act_select",))   # the path, not the fidelity: OBS on a 5120-wide FF is ~1 h on 2 cores


def _rss_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _subset(session: Session):
    """Four sites: the first and the deepest FeedForward and ResBlock (by the model's order and width)."""
    ff = [s for s in session.site_list if s.kind == "ff"]
    res = [s for s in session.site_list if s.kind == "res"]
    keep = {ff[0].name, max(ff, key=lambda s: s.width).name, res[0].name, max(res, key=lambda s: s.width).name}
    session.site_list = [s for s in session.site_list if s.name in keep]
    session.site_order = [s.name for s in session.site_list]
    session.site_by_name = {s.name: s for s in session.site_list}


def real_shapes(family: str, cache: Path, out: Path, row: dict, save, plan_only: bool = False,
                default_plan: bool = True, short_latent: int | None = None):
    """Fills ``row`` (``save()`` after each part, so a long run that is stopped keeps what it measured)."""
    path = cache / f"{family}_random.safetensors"
    if not path.exists():
        t0 = time.perf_counter()
        random_checkpoint.write(path, family)
        print(f"{family}: wrote {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    ckpt = open_checkpoint(path)
    t0 = time.perf_counter()
    cond = PromptEncoder(path, family).encode(PROMPTS, "blurry, low quality")
    encode_s = time.perf_counter() - t0
    calib = Calibration.from_conditioning(cond)
    calib.time_ids = None
    weights, cfg = teacher_weights(ckpt, ckpt.config)
    row.update(family=family, params=sum(v.numel() for v in weights.values()), encode_s=encode_s,
               tokenizer=cond.info["tokenizer"])
    if default_plan:      # (2) the default recipe's plan
        session = Session(weights, cfg, TrainConfig(), calib, out / f"{family}_default.safetensors", None, False)
        plan = make_plan(session)
        row["default_plan"] = plan.to_dict()
        total = plan.eta_s
        row["default_plan"]["shares"] = {p.name: p.seconds / total for p in plan.phases}
        print(plan.text(), file=sys.stderr)
        save()
        old = copy.copy(session)                      # v0.2's default allocation, costed with the same warm-up
        old.tc = TrainConfig(allocation="e2e", alloc_inputs=32)
        bank = bank_size(old)
        v02 = Plan(_phases(old, plan.warmup, bank, _stage2_inputs(old, bank)), plan.work_bytes, plan.warmup)
        row["v02_plan"] = {"eta_s": v02.eta_s, "phases": v02.to_dict()["phases"],
                           "shares": {p.name: p.seconds / v02.eta_s for p in v02.phases}}
        del session, old
        save()
    if plan_only:
        return
    # (3) a short run of the real phases on four sites
    stamps = []
    # four sites train in one group, where auto does not checkpoint: SDXL's stage-2 step at 128² needs it on 24 GiB
    tc = TrainConfig(**SHORT, grad_ckpt=True if family == "sdxl" else "auto", latent_size=short_latent)
    session = Session(weights, cfg, tc, calib, out / f"{family}_short.safetensors", None, False)
    _subset(session)
    short_plan = make_plan(session)
    session.progress.callback = lambda done, n, info: stamps.append((time.perf_counter(), info.get("stage")))
    t0 = time.perf_counter()
    result = execute(session)
    wall = time.perf_counter() - t0
    timing = result.report.timing
    traj_end = max((t for t, stage in stamps if stage == "calibration"), default=t0)
    traj_s = (traj_end - t0) / tc.n_trajectories
    capture_inputs = next(p.units for p in short_plan.phases if p.name == "capture")
    row["short_run"] = {
        "sites": session.site_order, "wall_s": wall, "timing": timing,
        "per_unit_s": {"trajectory_20_steps": traj_s * 20 / tc.sample_steps,
                       "captured_input": max(0.0, timing["calibration_s"] - traj_s * tc.n_trajectories)
                       / max(capture_inputs, 1),
                       "rank_curve_site": timing.get("ranks_s", 0) / len(session.site_order),
                       "stage1_step": timing.get("stage1_s_per_step"), "stage2_step": timing.get("stage2_s_per_step")},
        "work_bytes": _folder_bytes(session.work_dir), "predicted": short_plan.to_dict(), "rss_peak_gib": _rss_peak_gib()}
    save()
    del session, result         # the session's teacher: the eval below loads its own (SDXL: 10 GB in fp32)
    # (4) the rest of the path: slim the checkpoint with these adapters, compare teacher and slim with a prompt
    adapters = out / f"{family}_short.safetensors"
    t0 = time.perf_counter()
    slim_checkpoint(path, adapters, out / f"{family}_slim.safetensors")
    slim_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ev = evaluate(path, adapters, seeds=1, steps=2, prompt=PROMPTS[0], negative="blurry, low quality", compare=(),
                  latent_size=short_latent)
    row["slim_eval"] = {"latent_size": ev["sampler"]["latent_size"], "slim_s": slim_s,
                        "eval_s": time.perf_counter() - t0, "conditioning": ev["conditioning"],
                        "eps_rel_error": ev["eps_rel_error"]["overall"], "latent_psnr_db": ev["latent_psnr_db"]["mean"],
                        "params": ev["params"]}
    save()


REDUCED = dict(uniform=True, stage1_steps=40, stage2_steps=40, n_trajectories=8, sample_steps=8)
REDUCED_PROMPTS = ["a red circle on a blue background", "a green square"]


def teacher_eta(name: str, out: Path, settings: str = "demo") -> dict:
    pipe = tiny.load_tiny_pipeline(tiny.TEACHERS[name].model)
    prompts = ([tiny_data.make_batch(1, i, 1).captions[0] for i in range(16)] if settings == "demo"
               else REDUCED_PROMPTS)
    calib = Calibration.from_prompts(prompts, pipe.encode_prompt, schedule=pipe.schedule)
    adapters = out / f"{name}_{settings}.safetensors"
    t0 = time.perf_counter()
    r = train_adapters(pipe.unet, pipe.checkpoint.config, calib, out_path=adapters, ratio=0.5,
                       latent_size=pipe.latent_size, plan=True, **(FULL if settings == "demo" else REDUCED))
    wall = time.perf_counter() - t0
    plan = r.report.plan
    after = plan.get("after_ranks", plan)           # a uniform run allocates nothing: its first plan stands
    measured = r.report.timing["total_s"]
    return {"teacher": name, "settings": settings, "measured_s": measured, "wall_s": wall, "eta_s": plan["eta_s"],
            "eta_after_ranks_s": after["eta_s"], "ratio": plan["eta_s"] / measured,
            "ratio_after_ranks": after["eta_s"] / measured, "timing": r.report.timing,
            "work_bytes": _folder_bytes(Path(r.report.work_dir)), "planned_work_bytes": plan["work_bytes"],
            "phases": {p["name"]: p["seconds"] for p in after["phases"]}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="sd15,sdxl")
    p.add_argument("--teachers", default="tiny,wide")
    p.add_argument("--teacher-settings", default="demo", help="demo and/or reduced (comma-separated)")
    p.add_argument("--out", default="out/real_size")
    p.add_argument("--cache", default=None, help="folder for the random checkpoints (default: --out)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plan-only", action="store_true", help="encode and plan only: no short run, slim or eval")
    p.add_argument("--no-default-plan", action="store_true",
                   help="skip (2), the default recipe's plan (SDXL's warm-up alone is ~32 min on 2 cores)")
    p.add_argument("--short-latent", type=int, default=None,
                   help="latent size of the short run and the eval (default: the model's, 64 SD1.5, 128 SDXL)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else out
    cache.mkdir(parents=True, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "families": [], "teachers": []}
    for fam in [f for f in args.families.split(",") if f]:
        if fam not in layout.FAMILIES:
            raise SystemExit(f"unknown family {fam}")
        row = {}
        results["families"].append(row)
        real_shapes(fam, cache, out, row, lambda: (out / "real_size.json").write_text(json.dumps(results, indent=1)),
                    args.plan_only, not args.no_default_plan, args.short_latent)
    for settings in [s for s in args.teacher_settings.split(",") if s]:
        if settings not in ("demo", "reduced"):
            raise SystemExit(f"unknown --teacher-settings {settings}")
        for name in [t for t in args.teachers.split(",") if t]:
            results["teachers"].append(teacher_eta(name, out, settings))
            (out / "real_size.json").write_text(json.dumps(results, indent=1))
    for row in results["families"]:
        plan = row.get("default_plan")
        if plan is None:
            plan = {"eta_s": float("nan"), "work_bytes": float("nan"), "shares": {}, "phases": []}
            row.setdefault("v02_plan", {"eta_s": float("nan"), "shares": {}})
        print(f"\n{row['family']} default recipe (plan): ETA {plan['eta_s'] / 3600:.2f} h, work folder "
              f"{plan['work_bytes'] / 2 ** 30:.2f} GiB; rank curves {plan['shares'].get('rank curves', 0):.1%} "
              f"(v0.2's e2e allocation: ETA {row['v02_plan']['eta_s'] / 3600:.2f} h, rank curves "
              f"{row['v02_plan']['shares'].get('rank curves', 0):.1%})")
        for ph in plan["phases"]:
            print(f"  {ph['name']:<12} {ph['units']:>6} {ph['unit']:<6} fwd {ph['forwards']:>7} bwd "
                  f"{ph['backwards']:>6}  {ph['seconds'] / 60:8.1f} min")
        if "short_run" not in row:
            continue
        s = row["short_run"]
        print(f"  short run ({len(s['sites'])} sites): wall {s['wall_s']:.0f} s (plan {s['predicted']['eta_s']:.0f} s), "
              f"work {s['work_bytes'] / 2 ** 20:.0f} MiB (plan {s['predicted']['work_bytes'] / 2 ** 20:.0f} MiB), "
              f"RSS peak {s['rss_peak_gib']:.1f} GiB; per unit: " +
              ", ".join(f"{k} {v:.2f} s" for k, v in s["per_unit_s"].items() if v is not None))
        e = row["slim_eval"]
        print(f"  slim {e['slim_s']:.0f} s, eval --prompt {e['eval_s']:.0f} s: eps error {e['eps_rel_error']:.4f}, "
              f"params {e['params']['teacher'] / 1e6:.0f}M -> {e['params']['slim'] / 1e6:.0f}M")
    for t in results["teachers"]:
        print(f"{t['teacher']} ({t['settings']}): measured {t['measured_s']:.0f} s; ETA before the run "
              f"{t['eta_s']:.0f} s (×{t['ratio']:.2f}), after the rank allocation {t['eta_after_ranks_s']:.0f} s "
              f"(×{t['ratio_after_ranks']:.2f}); work folder {t['work_bytes'] / 2 ** 20:.1f} MiB, planned "
              f"{t['planned_work_bytes'] / 2 ** 20:.1f} MiB (×{t['planned_work_bytes'] / t['work_bytes']:.2f})")


if __name__ == "__main__":
    main()
