"""The fidelity ladder: slim UNets next to what users pick instead (fp8 storage, GGUF Q8_0 … Q4_0), same teacher,
same seeds, same prompts, same LoRA and ControlNet.

    .venv/bin/python bench/fidelity.py [--teachers tiny,wide] [--targets 0.85,0.75,half,0.55]
        [--budgets init,demo,long | data-free,quick,full] [--modes uniform,params,flops] [--long-at half] [--trained-at half]
        [--gguf Q8_0,Q5_1,Q5_0,Q4_1,Q4_0] [--stack fp8,Q8_0,Q5_0,Q4_0] [--out out/bench-fidelity] [--reuse]
        [--ablation] [--allocation anchored|e2e|site] [--alloc-inputs N]

For each shipped teacher (``tiny``: base width 32; ``wide``: base width 64) and each target slim parameter ratio
(``half`` = SD1.5's ratio at uniform width ½, 0.614), rows: uniform ranks, ranks allocated at equal parameters and
ranks allocated at uniform's forward FLOPs (``--budget-by flops``), training-free (``init``), after the demo's
training budget (``demo``) and after a longer one (``long``, at ``--long-at`` targets only), or the recipes of
``sdslim train --recipe`` (``data-free``: uniform ranks from the weights alone; ``quick`` and ``full`` exactly as
the CLI runs them, allocated at equal parameters; ``sdslim_core.train.recipes``); the alternatives in
the same table; each target's best allocated slim model stacked with the ``--stack`` formats. Every GGUF row comes
from a written file: ``sdslim slim``'s writer (``apps.slim.slim_checkpoint(..., quant=TYPE)``, the teacher unslimmed
or the slim model without embedded adapters) into ``--out``/gguf, read back through the gguf package's dequantiser
(``io.gguf.read_unet``), the LoRA added to the dequantised weights as ComfyUI-GGUF adds it; its bytes are the
file's size on disk. CPU time is the training process's CPU seconds (calibration included). Columns: params ×,
weight bytes (fp16 and fp8: the weights' own; GGUF: the file), UNet forward FLOPs ×, same-seed latent PSNR, image
PSNR / SSIM, ε relative error (and
CFG-guided), LoRA-effect cosine, ControlNet-effect cosine. ``--ablation`` adds the held-out per-site error of each
initialisation step (v0.1's act_select → whole norm2 groups → OBS selection → FF intercept) and the whole-UNet
error of a sequential refit of the allocated init.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from sdslim_core.io import adapters
from sdslim_core.apps import fidelity
from sdslim_core import layout, tiny
from sdslim_core.ops import lora, quant
from sdslim_core.layout import rank_policy
from sdslim_core.tiny import data as tiny_data  # noqa: E402
from sdslim_core.apps.demo import FULL, PROMPTS_SEED
from sdslim_core.ops.sampling import diffusers_fn
from sdslim_core.train import Calibration, TrainConfig, train_adapters  # noqa: E402
from sdslim_core.train import ranks as ranks_mod, recipes  # noqa: E402

BUDGETS = {"init": dict(FULL, stage1_steps=0, stage2_steps=0),
           "demo": dict(FULL),
           "long": dict(FULL, stage1_steps=1200, stage2_steps=6000, n_trajectories=48),
           **{name: recipes.settings(name) for name in ("quick", "full")}}
RECIPE_BUDGETS = ("data-free", "quick", "full")


def sd15_half() -> float:
    """SD1.5's slim/original parameter ratio at uniform width ½ (real layout, counted on shapes)."""
    from sdslim_core.modules.unet import canonical_shapes
    shapes = canonical_shapes(layout.config_for_arch("sd15"))
    ranks = rank_policy.ranks_for_ratio(layout.sites(shapes), 0.5)
    return ranks_mod.slim_param_count(shapes, ranks) / ranks_mod.slim_param_count(shapes, {})


def uniform_ratio_for(shapes: dict, target: float) -> float:
    """The uniform width fraction whose slim parameter count is closest to ``target`` × the original."""
    site_list = layout.sites(shapes)
    full = ranks_mod.slim_param_count(shapes, {})

    def params(r):
        return ranks_mod.slim_param_count(shapes, rank_policy.ranks_for_ratio(site_list, r)) / full
    grid = [i / 200 for i in range(1, 201)]
    return min(grid, key=lambda r: (abs(params(r) - target), -r))


class Teacher:
    """One shipped teacher with everything the ladder compares on."""

    def __init__(self, name: str, n_images: int = 12, seed: int = 0, reuse: bool = False, allocation=None,
                 model: Path | None = None):
        """``model``: another checkpoint of the same layout (a derivative of teacher ``name``), run with ``name``'s
        LoRA and ControlNet."""
        self.name, self.reuse = name, reuse
        self.allocation = dict(allocation or {})         # TrainConfig's allocation / alloc_inputs for every training
        self.assets = assets = tiny.TEACHERS[name]
        self.model = Path(model or assets.model)
        self.pipe = tiny.load_tiny_pipeline(self.model)
        self.cfg = self.pipe.checkpoint.config
        self.weights = {k: v.float() for k, v in self.pipe.checkpoint.weights.items()}
        self.shapes = {k: tuple(v.shape) for k, v in self.weights.items()}
        merged, _ = lora.merge_loras(self.weights, [(assets.lora, 1.0)], self.cfg)
        self.candidates = fidelity.Candidates(self.cfg, self.weights, merged)
        teacher_lora = self.candidates.unet({**self.weights, **merged})
        batch = tiny_data.make_batch(PROMPTS_SEED, 0, n_images)
        control = tiny.controlnet_hook(tiny.load_tiny_controlnet(assets.controlnet), batch.masks)
        self.probe = fidelity.Probe(fn_of=diffusers_fn, context=self.pipe.encode_prompt(batch.captions),
                                    uncond=self.pipe.encode_prompt([""] * n_images),
                                    noise=self.pipe.noise(n_images, seed + 7), schedule=self.pipe.schedule, steps=20,
                                    guidance=4.0, decode=self.pipe.decode, control=control)
        self.ref = fidelity.reference(self.probe, self.pipe.unet, teacher_lora)
        x = self.probe.noise[:1]
        self.flop_args = (x, torch.tensor([500.0]), self.probe.context[:1])
        self.flops = fidelity.forward_flops(self.pipe.unet, *self.flop_args)
        self.params = ranks_mod.slim_param_count(self.shapes, {})
        self.calib_prompts = [tiny_data.make_batch(seed + 1, i, 1).captions[0] for i in range(16)]

    def row(self, label: str, model, model_lora, weights: dict, method: str | None, cpu_s: float | None) -> dict:
        r = fidelity.compare(self.probe, self.ref, model, model_lora)
        r.pop("images", None)
        r.pop("detail", None)
        n = sum(v.numel() for v in weights.values())
        r.update(label=label, params_ratio=n / self.params, bytes=quant.storage_bytes(weights, method),
                 flops_ratio=fidelity.forward_flops(model, *self.flop_args) / self.flops, cpu_s=cpu_s)
        return r

    def gguf_row(self, label: str, aset, qtype: str, path: Path, cpu_s: float | None) -> dict:
        """The row of a written ``.gguf`` (the teacher when ``aset`` is None, else its slim form), read back."""
        from sdslim_core.apps.slim import slim_checkpoint
        from sdslim_core.io import gguf
        slim_checkpoint(self.model, aset, path, quant=qtype, embed_adapters=False)
        stored, _, _ = gguf.read_unet(path)
        model, model_lora = self.candidates.from_file(stored, aset)
        r = self.row(label, model, model_lora, stored, None, cpu_s)
        r.update(bytes=path.stat().st_size, file=str(path), gguf_type=qtype)
        return r

    def train(self, ratio: float, mode: str, budget: str, work: Path, **overrides):
        """``mode``: ``uniform`` ranks, or ranks allocated at the ``params`` or the forward ``flops`` of uniform
        ``ratio``; ``overrides``: further :class:`TrainConfig` fields (they win over the budget's)."""
        tc = TrainConfig(ratio=ratio, uniform=mode == "uniform", budget_by="flops" if mode == "flops" else "params",
                         guidance=4.0, latent_size=self.pipe.latent_size, seed=0, work_dir=str(work),
                         **{**BUDGETS.get(budget, {}), **self.allocation, **overrides})
        out, record = work / "adapters.safetensors", work / "cpu_s.json"
        if self.reuse and out.exists() and record.exists():
            return adapters.AdapterSet.load(out), json.loads(record.read_text())["cpu_s"]
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.process_time()
        if budget == "data-free":
            aset, _ = recipes.data_free(self.pipe.unet, self.cfg, TrainConfig(ratio=ratio, uniform=True), out)
            record.write_text(json.dumps({"cpu_s": time.process_time() - t0}))
            return aset, json.loads(record.read_text())["cpu_s"]
        res = train_adapters(self.pipe.unet, self.cfg, Calibration.from_prompts(self.calib_prompts,
                                                                                self.pipe.encode_prompt),
                             tc, out)
        cpu_s = time.process_time() - t0
        record.write_text(json.dumps({"cpu_s": cpu_s}))
        return res.adapters, cpu_s


def ablation(t: Teacher, ratio: float, work: Path) -> dict:
    """Held-out per-site error of each initialisation step at uniform ``ratio`` (mean over FF / Res sites)."""
    from sdslim_core.train.calibration import calibrate
    from sdslim_core.modules import swap
    from sdslim_core.train.init import site_init
    from sdslim_core.train.session import Session
    from sdslim_core.train.teacher import teacher_weights
    tc = TrainConfig(ratio=ratio, uniform=True, guidance=4.0, latent_size=t.pipe.latent_size, seed=0,
                     work_dir=str(work), **BUDGETS["init"])
    weights, cfg = teacher_weights(t.pipe.unet, t.cfg)
    run = Session(weights, cfg, tc, Calibration.from_prompts(t.calib_prompts, t.pipe.encode_prompt),
                  work / "adapters.safetensors", None, False)
    fp = run.fingerprint()
    run.prepare_work_dir(fp)
    _, store = calibrate(run, fp)
    out: dict = {}
    for site in run.site_order:
        s = run.site_by_name[site]
        r = rank_policy.rank_for_ratio(s.width, ratio, s.kind)
        si = site_init(run, store, site)
        st = si.stats

        def err(tensors, groups):
            student, _ = swap.train_site(si.site_mod, site, s.kind, run.naming, tensors, groups)
            return si.data.eval_error(student, run.device, run.compute_dtype, run.amp)
        if s.kind == "ff":
            steps = {"v0.1 act_select": err(st.act_select(r), 0),
                     "+ OBS selection": err(st.obs(r, intercept=False), 0),
                     "+ intercept (up_bias)": err(st.obs(r), 0)}
        else:
            old = rank_policy.DEFAULT_GROUPS if r == s.width else rank_policy.norm_groups_for(r)
            groups = rank_policy.res_groups(s.width, r)
            steps = {"v0.1 act_select": err(st.act_select(r), old),
                     "+ whole norm2 groups": err(st.obs(r, greedy=False), groups),
                     "+ OBS selection": err(st.obs(r), groups)}
        for k, v in steps.items():
            out.setdefault(s.kind, {}).setdefault(k, []).append(v)
    return {kind: {k: sum(v) / len(v) for k, v in d.items()} for kind, d in out.items()}, run


def sequential_refit(run, aset: adapters.AdapterSet, passes: int = 2, n_inputs: int = 256) -> list:
    """Sequential calibration, measured: refit every site's U (and FF intercept) by least squares from the
    bottleneck activations the *slimmed* UNet produces (its upstream sites already slim) to the teacher's hidden
    activations on the same inputs; returns the whole-UNet held-out error before and after each pass."""
    from sdslim_core.modules import swap
    from sdslim_core.train import stage2
    from sdslim_core.train.calibration import unet_call
    fit = run.bank.fit_ids()[:n_inputs]

    def capture(model, hooks_on):
        got = {s: [] for s in hooks_on}
        handles = [mod.register_forward_hook(lambda m, i, o, s=s, f=f: got[s].append(f(i[0])))
                   for s, (mod, f) in hooks_on.items()]
        with torch.no_grad():
            for i in range(0, fit.numel(), 16):
                unet_call(model, run.bank.batch(fit[i:i + 16]))
        for h in handles:
            h.remove()
        return {s: torch.cat(v) for s, v in got.items()}
    errors = [stage2.measure(run, aset, run.bank)]
    for _ in range(passes):
        tree, _ = swap.attach_train_adapters(run.teacher, aset)
        hooks_t, hooks_s = {}, {}
        for site in aset.sites:
            kind = aset.kind(site)
            key = "out" if kind == "ff" else "conv2"
            flat = (lambda x: x.reshape(-1, x.shape[-1]).double()) if kind == "ff" else \
                (lambda x: x.transpose(0, 1).flatten(1).T.double())
            hooks_t[site] = (run.teacher.get_submodule(swap.layer_paths(run.teacher, site, kind, run.cfg)[key]), flat)
            hooks_s[site] = (tree.get_submodule(swap.layer_paths(tree, site, kind, run.cfg)[key]), flat)
        target, inputs = capture(run.teacher, hooks_t), capture(tree, hooks_s)
        sites = {}
        for site, t in aset.sites.items():
            t, y, z = dict(t), target[site], inputs[site]
            ff = aset.kind(site) == "ff"
            mz, my = (z.mean(0), y.mean(0)) if ff else (0, 0)
            zc, yc = z - mz, y - my
            n, r = zc.shape
            gram = zc.T @ zc
            lam = float(gram.diagonal().mean()) * (1e-6 + r / n)
            up = torch.linalg.solve((gram + lam * torch.eye(r, dtype=gram.dtype)).T,
                                    (yc.T @ zc + lam * t["up"].double()).T).T
            t["up"] = up.float()
            if ff:
                t["up_bias"] = (my - up @ mz).float()
            sites[site] = t
        aset = adapters.AdapterSet(aset.family, sites, aset.norm_groups)
        errors.append(stage2.measure(run, aset, run.bank))
    return errors


def short(site: str) -> str:
    """input_blocks.4.1.transformer_blocks.0.ff → in4.ff, output_blocks.5.0 → out5.0 (res)."""
    s = site.replace("input_blocks.", "in").replace("output_blocks.", "out").replace("middle_block.", "mid")
    return s.replace(".1.transformer_blocks.0.ff", ".ff").replace(".transformer_blocks.0.ff", ".ff")


def fmt_row(r: dict) -> str:
    def f(v, spec):
        return "–" if v is None else (("inf" if v == float("inf") else format(v, spec)))
    cpu = "–" if r["cpu_s"] is None else f"{r['cpu_s'] / 60:.1f}"
    return (f"| {r['label']} | {r['params_ratio']:.3f} | {r['bytes'] / 1e6:.2f} | {r['flops_ratio']:.2f} | "
            f"{f(r['latent_psnr_db'], '.1f')} | {f(r.get('image_psnr_db'), '.1f')} | "
            f"{f(r.get('image_psnr_db_median'), '.1f')} | {f(r.get('image_ssim'), '.3f')} | "
            f"{f(r['eps_rel_error'], '.4f')} | {f(r.get('guided_eps_rel_error'), '.4f')} | "
            f"{f(r.get('lora_effect_cosine'), '.4f')} | {f(r.get('controlnet_effect_cosine'), '.4f')} | {cpu} |")


STORAGE = {"fp8": "fp8 e4m3fn storage"}

HEADER = ("| row | params × | MB | FLOPs × | latent PSNR dB | image PSNR dB | median image PSNR dB | SSIM | "
          "ε rel err | "
          "guided ε rel err | LoRA cos | ControlNet cos | train CPU-min |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teachers", default="tiny,wide")
    ap.add_argument("--targets", default="0.85,0.75,half,0.55")
    ap.add_argument("--budgets", default="init,demo,long")
    ap.add_argument("--long-at", default="half", help="targets that also get the long budget")
    ap.add_argument("--trained-at", default="", help="targets that get the training budgets (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ablation", action="store_true")
    ap.add_argument("--modes", default="uniform,params,flops",
                    help="rank modes of the training-free rows: uniform, params (allocated at equal params), flops")
    ap.add_argument("--gguf", default="Q8_0,Q5_1,Q5_0,Q4_1,Q4_0", help="GGUF types of the teacher rows (files)")
    ap.add_argument("--stack", default="fp8,Q8_0,Q5_0,Q4_0",
                    help="storage stacked on each target's best allocated slim model: fp8, or GGUF types (files)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse finished trainings in --out's work dirs (adapters + their recorded CPU time)")
    ap.add_argument("--out", default="out/bench-fidelity")
    ap.add_argument("--allocation", choices=("anchored", "e2e", "site"), default=None,
                    help="the rank allocation's error (default: TrainConfig's, anchored)")
    ap.add_argument("--alloc-inputs", type=int, default=None, help="held-out inputs per e2e measurement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    half = sd15_half()
    names = {"half": half}
    targets = [names.get(x, None) or float(x) for x in args.targets.split(",") if x]
    gguf_dir = out / "gguf"
    long_at = [names.get(x, None) or float(x) for x in args.long_at.split(",") if x]
    trained_at = [names.get(x, None) or float(x) for x in args.trained_at.split(",") if x] or targets
    budgets = args.budgets.split(",")
    results = {}
    for name in args.teachers.split(","):
        alloc = {k: v for k, v in (("allocation", args.allocation), ("alloc_inputs", args.alloc_inputs)) if v}
        t = Teacher(name, reuse=args.reuse, allocation=alloc)
        best_half = None
        rows = [t.row("teacher (fp16)", t.pipe.unet, t.candidates.unet({**t.weights, **t.candidates.lora_delta}),
                      t.weights, None, None)]
        m, ml, w = t.candidates.quantised("fp8")
        rows.append(t.row(STORAGE["fp8"], m, ml, w, "fp8", None))
        for qtype in [q for q in args.gguf.split(",") if q]:
            rows.append(t.gguf_row(f"GGUF {qtype}", None, qtype, gguf_dir / f"{name}-teacher-{qtype}.gguf", None))
        print(f"\n## {name} teacher\n\n{HEADER}", flush=True)
        for r in rows:
            print(fmt_row(r), flush=True)
        for target in targets:
            ratio = uniform_ratio_for(t.shapes, target)
            tag = f"{target:.3f}" + (" (SD1.5 half)" if target == half else "")
            best = None
            for budget in budgets:
                if budget == "long" and target not in long_at or budget not in ("init", "data-free") and \
                        target not in trained_at:
                    continue
                modes = args.modes.split(",") if budget == "init" else ("uniform",) if budget == "data-free" \
                    else ("params",)
                for mode in modes:
                    work = out / "work" / f"{name}-{target:.3f}-{budget}-{mode}"
                    aset, cpu = t.train(ratio, mode, budget, work)
                    m, ml, w = t.candidates.slim(aset)
                    label = f"slim {tag}, " + {"uniform": "uniform ranks", "params": "allocated ranks",
                                               "flops": "ranks allocated at uniform's FLOPs"}[mode] + f", {budget}"
                    r = t.row(label, m, ml, w, None, cpu)
                    r["ranks"] = aset.ranks()
                    rows.append(r)
                    print(fmt_row(r), flush=True)
                    widths = {s.name: s.width for s in layout.sites(t.shapes)}
                    print("    ranks: " + ", ".join(f"{short(site)} {aset.ranks().get(site, w)}/{w}"
                                                    for site, w in widths.items()), file=sys.stderr, flush=True)
                    if mode == "params":
                        best = (aset, cpu, budget)
                        if budget == "init" and target == half:
                            best_half = aset
            for method in (args.stack.split(",") if best is not None and args.stack else ()):
                label = f"slim {tag}, allocated, {best[2]} + "
                if method == "fp8":
                    m, ml, w = t.candidates.slim(best[0], method)
                    r = t.row(label + STORAGE[method], m, ml, w, method, best[1])
                else:
                    r = t.gguf_row(label + f"GGUF {method}", best[0], method,
                                   gguf_dir / f"{name}-slim{target:.3f}-{best[2]}-{method}.gguf", best[1])
                rows.append(r)
                print(fmt_row(r), flush=True)
        results[name] = {"rows": rows, "sd15_half": half}
        if args.ablation:
            sites, run = ablation(t, 0.5, out / "work" / f"{name}-ablation")
            results[name]["ablation"] = {"site_error_uniform_0.5": sites}
            print(f"\nheld-out site error at uniform width 0.5 ({name}): " + json.dumps(sites, indent=1), flush=True)
            if best_half is not None:
                seq = sequential_refit(run, best_half)
                results[name]["ablation"]["sequential_refit_e2e"] = seq
                print(f"sequential calibration (refit U from slimmed-upstream inputs), whole-UNet held-out error "
                      f"of the allocated init at SD1.5-half params: {' -> '.join(f'{e:.4f}' for e in seq)}",
                      flush=True)
        (out / "results.json").write_text(json.dumps(fidelity.jsonable(results), indent=1, default=str))
        md = "\n\n".join(f"## {n} teacher\n\n{HEADER}\n" + "\n".join(fmt_row(r) for r in res["rows"])
                          for n, res in results.items())
        (out / "results.md").write_text(md + "\n")
    print(f"\nwrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
