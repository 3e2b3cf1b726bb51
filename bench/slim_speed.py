"""`sdslim slim` on a full-size SD1.5 layout (random fp16 weights): the fold's time and peak RAM, and LoRAs applied
to the slim checkpoint in slim space vs a full re-fold, all side by side in one run.

    .venv/bin/python bench/slim_speed.py [--threads 2] [--ratio 0.5] [--before TREE] [--no-baseline] [--results bench/RESULTS.md]

Generates, in a temporary folder that is deleted afterwards: an SD1.5 single-file checkpoint (UNet with
``model.diffusion_model.`` keys, random fp16, ~1.7 GB, plus fake VAE/text-encoder tensors), dense random adapters
(every site, width ratio ``--ratio``, fp16) and three rank-16 LoRAs (kohya names, fp16): a LoRA (attention, FF,
proj_in/out), a LoCon (the same plus the ResBlock 3×3 convs) and a LoHa (the LoCon's layers). Then runs, each in its
own process with ``--threads`` intra-op threads:

- the one-time fold (``sdslim slim`` without LoRA; it writes the slim checkpoint with its adapters embedded), and
  the fold with the LoCon merged first (the 25.3 s figure of the issue), with this tree and, given ``--before``, with
  another source tree (e.g. ``git archive`` of the previous commit), interleaved;
- a full re-fold per LoRA (what a LoRA change cost before slim-space LoRAs) vs ``sdslim slim --ckpt SLIM --lora``
  (file to file, no re-fold), and the in-memory application a host does (parse + convert into slim space, then
  merge into the loaded slim weights), with the slim-space result compared to the re-fold;
- a fp32 matrix product of known size, for the machine's GEMM rate (the fold is ~1.3 TFLOP of it);
- the naive in-memory baseline of the fold (load all, merge, fold, save) and an import-only process, whose peak RSS
  is subtracted to get the *extra* RAM of each.

Peak RSS is the child's own ``getrusage(RUSAGE_SELF).ru_maxrss``. Prints the figures and appends a section to
bench/RESULTS.md (replacing an earlier one of this script).
"""
import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECTION = "## `sdslim slim`: time and peak RAM, SD1.5 full size (`bench/slim_speed.py`)"
PREFIX = "model.diffusion_model."
EXTRA = {"first_stage_model.decoder.conv_out.weight": (3, 128, 3, 3),
         "cond_stage_model.transformer.text_model.final_layer_norm.weight": (768,)}
LORA_LAYERS = (".attn1.", ".attn2.", ".ff.net.", ".proj_in", ".proj_out")
CONV_LAYERS = (".in_layers.2", ".out_layers.3")

# Child wrapper: run a command in-process, then write its own peak RSS (KiB on Linux) to a file.
CHILD = """
import resource, runpy, sys, json
out = sys.argv[1]; mode = sys.argv[2]; sys.argv = sys.argv[2:]
code = 0
try:
    if mode == "import":
        import torch, sdslim_core.apps.slim, sdslim_core.cli, sdslim_core.ops.lora  # noqa
    elif mode == "script":
        runpy.run_path(sys.argv[1], run_name="__script__")
    else:
        from sdslim_core.cli import main
        code = main(sys.argv[1:])
finally:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    open(out, "w").write(json.dumps({"maxrss_kib": ru.ru_maxrss, "cpu_s": ru.ru_utime + ru.ru_stime}))
sys.exit(code)
"""

# The naive baseline: everything in memory, same core functions.
NAIVE = """
import sys
sys.path.insert(0, {root!r})
from sdslim_core import fold, layout
from sdslim_core.io.adapters import AdapterSet
from sdslim_core.ops.lora import merge_loras
from sdslim_core.io.tensors import load_file, save_file_atomic
tensors, meta = load_file({ckpt!r})
canon, naming, prefix = layout.to_canonical(tensors)
cfg = layout.config_from_state_dict(canon)
aset = AdapterSet.load({adapters!r})
merged, report = merge_loras(canon, [({lora!r}, 0.8)], cfg)
both = dict(canon); both.update(merged)
folded = fold.fold_state_dict(both, aset)
out = dict(tensors)
for k in set(merged) | set(folded):
    v = folded.get(k, merged.get(k))
    out[prefix + k] = v.to(tensors[prefix + k].dtype)
save_file_atomic(out, {out!r}, meta)
"""

# A host's view: the slim checkpoint loaded in memory (adapters included), then each LoRA parsed, converted into slim
# space and added in place to the slim weights (fp16 weights, float32 arithmetic), timed per phase. (The LoRAs stack:
# the values do not matter for the timing; the CLI runs check them.)
IN_MEMORY = """
import json, sys, time
sys.path.insert(0, {root!r})
import torch
from sdslim_core import lora, slim
from sdslim_core.io.adapters import AdapterSet
from sdslim_core.ops.lora_slim import SlimSpace
from sdslim_core.io.tensors import load_file
t0 = time.perf_counter()
tensors, meta = load_file({slim_path!r})
view = slim.open_slim({slim_path!r})
weights = {{k: tensors[f].clone() for k, f in view.file_keys.items()}}      # in memory, as a host holds them
p = meta[slim.ADAPTER_KEY]
aset = AdapterSet.from_state_dict(view.space.adapters.family, {{k[len(p):]: v.clone() for k, v in tensors.items()
                                  if k.startswith(p)}}, view.space.adapters.norm_groups)
load_s = time.perf_counter() - t0
out = {{"load_s": load_s}}
for name, path in {loras!r}:
    space = SlimSpace.for_slim(aset, view.shapes)
    c0, t0 = time.process_time(), time.perf_counter()
    merger = lora.LoraMerger([(path, 0.8)], view.config, space.full_shapes, fold_sites=aset)
    t1 = time.perf_counter()
    plan = {{k: [(space.convert(m, (part,)), s, part) for m, s, part in v] for k, v in merger.plan.items()}}
    t2 = time.perf_counter()
    for k, v in plan.items():                # in place, as a host updates its loaded weights
        lora.apply_deltas(weights[k], [e for e in v if e[0] is not None], out=weights[k])
    t3 = time.perf_counter()
    out[name] = {{"parse_s": t1 - t0, "convert_s": t2 - t1, "merge_s": t3 - t2, "total_s": t3 - t0,
                 "cpu_s": time.process_time() - c0, "tensors": len(plan)}}
    del plan
print(json.dumps(out))
"""

# Agreement of two slim checkpoints' UNet tensors (the slim-space result vs the re-fold), relative to the tensor.
COMPARE = """
import json, sys
sys.path.insert(0, {root!r})
from sdslim_core.io.tensors import LazyStateDict
a, b = LazyStateDict({a!r}), LazyStateDict({b!r})
worst, name, ulps = 0.0, None, 0.0
for k in a:
    if not k.startswith({prefix!r}):
        continue
    x, y = a[k].double(), b[k].double()
    if y.norm() > 0:
        e = ((x - y).norm() / y.norm()).item()
        if e > worst:
            worst, name = e, k
print(json.dumps({{"worst_rel": worst, "key": name}}))
"""

# The machine's fp32 GEMM rate with the same threads.
GEMM = """
import json, time, torch
a, b = torch.randn(2560, 5120), torch.randn(5120, 1280)
a @ b
times, c0 = [], time.process_time()
for _ in range(5):
    t0 = time.perf_counter()
    a @ b
    times.append(time.perf_counter() - t0)
flop = 2 * 2560 * 5120 * 1280
print(json.dumps({"gflops": flop / min(times) / 1e9, "gflop_per_cpu_s": 5 * flop / (time.process_time() - c0) / 1e9}))
"""


def generate_checkpoint(path: Path, shapes: dict, seed: int = 0, cfg=None):
    """Random fp16 checkpoint (SD1.5 unless ``cfg``, a UNetConfig matching ``shapes``, says otherwise) written
    tensor by tensor (never the whole model in memory)."""
    import torch
    from sdslim_core import layout
    from sdslim_core.io.tensors import write_safetensors_streaming
    from sdslim_core.layout import UNET_CONFIG_KEY
    g = torch.Generator().manual_seed(seed)
    entries = [(PREFIX + k, torch.float16, tuple(s)) for k, s in shapes.items()]
    entries += [(k, torch.float16, s) for k, s in EXTRA.items()]

    index = {k: s for k, _, s in entries}

    def produce(key):
        shape = index[key]
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
        return (torch.randn(shape, generator=g) / math.sqrt(fan_in)).half()
    cfg = cfg or layout.config_for_arch("sd15")
    write_safetensors_streaming(path, entries, produce, {UNET_CONFIG_KEY: json.dumps(cfg.to_dict())})


def dense_adapters(shapes: dict, ratio: float, seed: int = 1):
    """Dense random adapters for every site (as trained adapters are; no selection shortcut)."""
    import torch
    from sdslim_core import layout
    from sdslim_core.io import adapters
    from sdslim_core.layout import rank_policy
    g = torch.Generator().manual_seed(seed)
    site_list = layout.sites(shapes)
    ranks = rank_policy.ranks_for_ratio(site_list, ratio)
    sites, groups = {}, {}
    for s in site_list:
        r, m = ranks[s.name], s.width

        def rnd(*shape):
            return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])
        if s.kind == "ff":
            sites[s.name] = {"down_value": rnd(r, m), "down_gate": rnd(r, m), "up": rnd(m, r)}
        else:
            sites[s.name] = {"down": rnd(r, m), "norm.weight": 1 + 0.1 * torch.randn(r, generator=g),
                             "norm.bias": 0.1 * torch.randn(r, generator=g), "up": rnd(m, r)}
            groups[s.name] = rank_policy.norm_groups_for(r)
    return adapters.AdapterSet("sd15", sites, {k: v for k, v in groups.items() if v != 32})


def rank16(shapes: dict, form: str, rank: int = 16, seed: int = 2) -> dict:
    """A rank-16 kohya-named file: ``lora`` (attention, FF, proj_in/out), ``locon`` (plus the Res 3×3 convs, 3×3 down
    and 1×1 up) or ``loha`` (LoHa, flattened factors, on the LoCon's layers)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    layers = LORA_LAYERS if form == "lora" else LORA_LAYERS + CONV_LAYERS
    out = {}
    for k, s in shapes.items():
        if not k.endswith(".weight") or len(s) < 2 or not any(t in k for t in layers):
            continue
        name = "lora_unet_" + k[:-len(".weight")].replace(".", "_")

        def rnd(*shape):
            return (torch.randn(*shape, generator=g) * 0.01).half()
        if form == "loha":
            flat = math.prod(s[1:])
            out.update({f"{name}.hada_w1_a": rnd(s[0], rank), f"{name}.hada_w1_b": rnd(rank, flat) * 10,
                        f"{name}.hada_w2_a": rnd(s[0], rank), f"{name}.hada_w2_b": rnd(rank, flat) * 10})
        else:
            out[f"{name}.lora_down.weight"] = rnd(rank, *s[1:])
            out[f"{name}.lora_up.weight"] = rnd(s[0], rank, *([1] * (len(s) - 2)))
        out[f"{name}.alpha"] = torch.tensor(float(rank / 2))
    return out


def write_inputs(folder: Path, shapes: dict, ratio: float, cfg=None) -> dict:
    """``sd15.safetensors`` (random checkpoint of ``shapes``), ``adapters.safetensors`` (dense, fp16) and rank-16
    ``lora``/``locon``/``loha.safetensors`` in ``folder``; returns the UNet's params, slim params, site count and
    the fold's FLOPs."""
    import torch
    from sdslim_core.io.tensors import save_file_atomic
    from sdslim_core.ops import fold
    generate_checkpoint(folder / "sd15.safetensors", shapes, cfg=cfg)
    aset = dense_adapters(shapes, ratio)
    aset.save(folder / "adapters.safetensors", dtype=torch.float16)
    for form in ("lora", "locon", "loha"):
        save_file_atomic(rank16(shapes, form), folder / f"{form}.safetensors")
    ranks = aset.ranks()
    flops = 0
    for site, r in ranks.items():
        if aset.kind(site) == "ff":
            d, m = shapes[f"{site}.net.2.weight"]
            flops += 3 * 2 * r * m * d
        else:
            flops += sum(2 * r * math.prod(shapes[f"{site}.{n}.weight"]) for n in ("in_layers.2", "emb_layers.1",
                                                                                    "out_layers.3"))
    return {"params": sum(math.prod(s) for s in shapes.values()),
            "slim_params": sum(math.prod(s) for s in fold.slim_shapes(shapes, ranks).values()), "sites": len(ranks),
            "fold_flops": flops}


def generate(folder: Path, ratio: float, threads: int):
    """Write the inputs into ``folder`` (run in a child process, so the measuring parent stays small)."""
    import torch
    from sdslim_core.apps.breakdown import canonical_shapes_for_arch
    torch.set_num_threads(threads)
    shapes, _ = canonical_shapes_for_arch("sd15")
    print(json.dumps(write_inputs(folder, shapes, ratio)))


def measure(argv: list, env: dict, workdir: Path) -> dict:
    """Run ``argv`` (a CHILD invocation); wall time, exact peak RSS (ru_maxrss) and sampled peak RSS."""
    import psutil
    stats = workdir / f"stats-{time.monotonic_ns()}.json"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(stats)] + argv, env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]
    stop = threading.Event()

    def sample():
        p = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], p.memory_info().rss)
            except psutil.Error:
                break
            time.sleep(0.01)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}): {' '.join(argv)}\n{err[-3000:]}")
    own = json.loads(stats.read_text())
    return {"seconds": wall, "cpu_s": own["cpu_s"], "peak_rss": own["maxrss_kib"] * 1024, "sampled_rss": peak[0],
            "stdout": out, "stderr": err}


def gib(n):
    return n / 2 ** 30


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of the measured processes")
    ap.add_argument("--ratio", type=float, default=0.5, help="adapter width ratio (default 0.5)")
    ap.add_argument("--before", default=None, help="another source tree (with sdslim_core/) to time the fold with, "
                                                   "side by side")
    ap.add_argument("--no-baseline", action="store_true", help="skip the naive in-memory baseline")
    ap.add_argument("--tmp", default=None, help="folder for the temporary files (default: system temp)")
    ap.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"), help="file to append the section to "
                                                                                   "('' to skip)")
    ap.add_argument("--generate", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate:
        return generate(Path(args.generate), args.ratio, args.threads)
    base_env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                    OMP_WAIT_POLICY="PASSIVE")

    def env_for(tree: Path):
        return dict(base_env, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env = env_for(ROOT)
    before = Path(args.before).resolve() if args.before else None
    if before and not any((before / "sdslim_core" / p).exists() for p in ("slim.py", "apps/slim.py")):
        raise SystemExit(f"--before {before}: not an sdslim tree (no sdslim_core/apps/slim.py or sdslim_core/slim.py)")
    load_start, pressure_start = os.getloadavg()[0], cpu_pressure()
    tmp = Path(tempfile.mkdtemp(prefix="sdslim-bench-", dir=args.tmp))
    runs = {}
    try:
        t0 = time.perf_counter()
        ckpt, ad = tmp / "sd15.safetensors", tmp / "adapters.safetensors"
        loras = {form: tmp / f"{form}.safetensors" for form in ("lora", "locon", "loha")}
        gen = subprocess.run([sys.executable, __file__, "--generate", str(tmp), "--ratio", str(args.ratio),
                              "--threads", str(args.threads)], env=env, capture_output=True, text=True)
        if gen.returncode:
            raise SystemExit(f"generation failed:\n{gen.stderr[-3000:]}")
        sizes = json.loads(gen.stdout)
        slim_params, n_sites = sizes["slim_params"], sizes["sites"]
        slim_bytes = slim_params * 2
        print(f"generated in {time.perf_counter() - t0:.1f} s: checkpoint {gib(ckpt.stat().st_size):.2f} GiB, "
              f"adapters {gib(ad.stat().st_size):.2f} GiB (fp16, {n_sites} sites, ratio {args.ratio}), LoRAs "
              + ", ".join(f"{f} {p.stat().st_size / 2 ** 20:.1f} MiB" for f, p in loras.items()), file=sys.stderr)

        def fold_cmd(out, lora=None):
            cmd = ["cli", "slim", "--ckpt", str(ckpt), "--adapters", str(ad), "--out", str(out), "--json"]
            return cmd + (["--lora", f"{lora}:0.8"] if lora else [])

        def step(key, argv, tree=ROOT):
            runs[key] = measure(argv, env_for(tree), tmp)
            print(f"  {key}: {runs[key]['seconds']:.1f} s", file=sys.stderr)
            return runs[key]

        step("import", ["import"])
        step("gemm", ["script", str(_script(tmp, "gemm.py", GEMM))])
        slim_ckpt = tmp / "slim.safetensors"
        # the one-time fold and the fold with a LoCon merged first: before/after interleaved
        if before:
            step("fold_before", fold_cmd(tmp / "x.safetensors"), before)
            (tmp / "x.safetensors").unlink()
        step("fold", fold_cmd(slim_ckpt))
        if before:
            step("fold_locon_before", fold_cmd(tmp / "x.safetensors", loras["locon"]), before)
            (tmp / "x.safetensors").unlink()
        for form, path in loras.items():         # a LoRA change before slim-space LoRAs: a full re-fold
            step(f"refold_{form}", fold_cmd(tmp / f"refold_{form}.safetensors", path))
        for form, path in loras.items():         # the same LoRA on the slim checkpoint: no re-fold
            step(f"slimspace_{form}", ["cli", "slim", "--ckpt", str(slim_ckpt), "--lora", f"{path}:0.8",
                                       "--out", str(tmp / f"ss_{form}.safetensors"), "--json"])
            cmp = measure(["script", str(_script(tmp, f"cmp_{form}.py", COMPARE.format(
                root=str(ROOT), a=str(tmp / f"ss_{form}.safetensors"), b=str(tmp / f"refold_{form}.safetensors"),
                prefix=PREFIX)))], env, tmp)
            runs[f"slimspace_{form}"]["agreement"] = json.loads(cmp["stdout"])
            for f in (f"ss_{form}.safetensors", f"refold_{form}.safetensors"):
                (tmp / f).unlink()
        step("in_memory", ["script", str(_script(tmp, "inmem.py", IN_MEMORY.format(
            root=str(ROOT), slim_path=str(slim_ckpt), loras=[(f, str(p)) for f, p in loras.items()])))])
        if not args.no_baseline:
            step("naive", ["script", str(_script(tmp, "naive.py", NAIVE.format(
                root=str(ROOT), ckpt=str(ckpt), adapters=str(ad), lora=str(loras["locon"]),
                out=str(tmp / "naive.safetensors"))))])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load_end = os.getloadavg()[0]
    pressure = f"{pressure_start} at the start, {cpu_pressure()} at the end (avg60)"
    report(args, runs, sizes, slim_bytes, load_start, load_end, before, pressure)


def _script(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def cpu_pressure() -> str:
    """The kernel's CPU pressure (``some avg60``, percent of time a task waited for a CPU), or ``n/a``."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return dict(x.split("=") for x in line.split()[1:])["avg60"] + " %"
    except (OSError, KeyError, IndexError, ValueError):
        return "n/a"


def report(args, runs, sizes, slim_bytes, load_start, load_end, before, pressure="n/a"):
    params, slim_params, n_sites = sizes["params"], sizes["slim_params"], sizes["sites"]
    base_rss = runs["import"]["peak_rss"]
    gemm_info = json.loads(runs["gemm"]["stdout"])
    gemm, gemm_cpu = gemm_info["gflops"], gemm_info["gflop_per_cpu_s"]
    fold_info = json.loads(runs["fold"]["stdout"])
    floor, cpu_floor = sizes["fold_flops"] / (gemm * 1e9), sizes["fold_flops"] / (gemm_cpu * 1e9)
    mem = json.loads(runs["in_memory"]["stdout"])
    out = [f"SD1.5 UNet {params / 1e6:.1f}M params -> slim {slim_params / 1e6:.1f}M ({slim_params / params:.3f}x); "
           f"slim model fp16 = {gib(slim_bytes):.3f} GiB; {args.threads} threads; load average {load_start:.1f} at "
           f"the start, {load_end:.1f} at the end"]

    def row(label, key):
        m = runs[key]
        extra = m["peak_rss"] - base_rss
        return (f"| {label} | {m['seconds']:.1f} s | {m['cpu_s']:.1f} s | {gib(m['peak_rss']):.2f} GiB | "
                f"{gib(extra):.2f} GiB | {extra / slim_bytes:.2f} |")
    table = ["| process | wall time | CPU time (all threads) | peak RSS | extra RAM (over import-only) | "
             "extra RAM / slim model |", "|---|---|---|---|---|---|",
             f"| import only (baseline RSS) | {runs['import']['seconds']:.1f} s | {runs['import']['cpu_s']:.1f} s | "
             f"{gib(base_rss):.2f} GiB | — | — |"]
    if before:
        table.append(row("one-time fold, before (`--before` tree)", "fold_before"))
    table.append(row("one-time fold (`sdslim slim`, no LoRA; adapters embedded)", "fold"))
    if before:
        table.append(row("fold with the LoCon merged first, before", "fold_locon_before"))
    table.append(row("fold with the LoCon merged first", "refold_locon"))
    if "naive" in runs:
        table.append(row("naive: load all, merge LoCon, fold, save", "naive"))
    lora_table = ["| rank-16 file | full re-fold, CLI (wall / CPU) | slim-space CLI `sdslim slim --ckpt SLIM --lora` "
                  "(wall / CPU) | in memory: parse | convert | merge | total wall (CPU) | slim-space vs re-fold "
                  "(worst tensor, rel.) |", "|---|---|---|---|---|---|---|---|"]
    for form in ("lora", "locon", "loha"):
        m, rf, ss = mem[form], runs[f"refold_{form}"], runs[f"slimspace_{form}"]
        lora_table.append(f"| {form} | {rf['seconds']:.1f} s / {rf['cpu_s']:.1f} s | {ss['seconds']:.1f} s / "
                          f"{ss['cpu_s']:.1f} s | {m['parse_s']:.2f} s | {m['convert_s']:.2f} s | {m['merge_s']:.2f} s "
                          f"| **{m['total_s']:.2f} s** ({m['cpu_s']:.2f} s) | {ss['agreement']['worst_rel']:.1e} |")
    inside = {k: json.loads(runs[k]["stdout"])["seconds"] for k in runs if k.startswith(("fold", "refold", "slimspace"))}
    text = "\n".join(out + ["", *table, "", *lora_table, ""])
    print("\n" + text)
    print(f"GEMM {gemm:.0f} GFLOP/s ({gemm_cpu:.0f} per CPU-s); fold {sizes['fold_flops'] / 1e12:.2f} TFLOP -> "
          f"floor {floor:.1f} s wall, {cpu_floor:.1f} s CPU; "
          f"inside the commands: " + ", ".join(f"{k} {v:.1f} s" for k, v in inside.items()))
    if not args.results:
        return
    command = " ".join([".venv/bin/python bench/slim_speed.py", f"--threads {args.threads}", f"--ratio {args.ratio}"]
                       + ([f"--before {args.before}"] if before else []) + (["--no-baseline"] if args.no_baseline
                                                                           else []))
    once, lora_ms = runs["fold"]["seconds"], mem["lora"]["total_s"]
    section = [SECTION, "",
               f"Command: `{command}` ({datetime.date.today()}; load average {load_start:.1f} at the start and "
               f"{load_end:.1f} at the end, on {os.cpu_count()} cores shared with other jobs; child processes use "
               f"{args.threads} threads, `OMP_WAIT_POLICY=PASSIVE`)", "",
               f"Input: random fp16 SD1.5 single-file checkpoint ({params / 1e6:.1f}M UNet params, "
               f"{gib(params * 2):.2f} GiB) + dense random fp16 adapters on all {n_sites} sites (ratio {args.ratio}) + "
               "rank-16 kohya files (strength 0.8): LoRA on attention/FF/proj, LoCon on those and the Res 3×3 convs, "
               f"LoHa on the LoCon's layers. Slim UNet: {slim_params / 1e6:.1f}M params ({slim_params / params:.3f}x), "
               f"{gib(slim_bytes):.3f} GiB in fp16.", "",
               *table, "",
               f"Embedded adapters: {fold_info['adapter_bytes'] / 2 ** 20:.1f} MiB in a {fold_info['file_bytes'] / 2 ** 20:.1f} "
               f"MiB slim file (+{fold_info['adapter_bytes'] / (fold_info['file_bytes'] - fold_info['adapter_bytes']):.0%}; "
               "`--no-embed-adapters` leaves them out and records the adapter file's sha256).", "",
               "LoRA changes on the slim checkpoint, same run:", "",
               *lora_table, "",
               f"In memory = what a host does with the slim checkpoint loaded (its {fold_info['adapter_bytes'] / 2 ** 20:.0f} "
               "MiB of adapters included): parse the LoRA against the original model's shapes, convert each module "
               "into slim space, add it to the fp16 slim weights in float32 (load time "
               f"{mem['load_s']:.1f} s not counted). The agreement column compares the slim-space file with the "
               "re-fold's file: both are exact in float64 (tests), the difference is fp16 rounding (the re-fold "
               "rounds once, slim space rounds the slim weight and then the sum).", "",
               "Wall times on this shared box depend on the other jobs (Linux CPU pressure, share of time some task "
               f"waited for a core: {pressure}); CPU time is what each process itself used, summed "
               f"over its threads, so on an idle {args.threads}-core box the wall time of the GEMM-bound fold "
               f"approaches CPU time / threads. In this run the {args.threads}-thread GEMM probe got "
               f"{gemm / gemm_cpu:.2f} cores' worth (CPU time / wall time).", "",
               f"Goals: a rank-16 LoRA applied to a slim SD1.5 ≤ 0.5 s — {'met' if lora_ms <= 0.5 else 'NOT met'} "
               f"({lora_ms:.2f} s wall, {mem['lora']['cpu_s']:.2f} s CPU, in memory); the one-time fold ≤ 15 s — "
               f"{'met' if once <= 15 else 'NOT met'} in wall time ({once:.1f} s, of which {inside['fold']:.1f} s "
               f"inside the command; the rest is Python/torch start-up), {runs['fold']['cpu_s']:.1f} s of CPU time. "
               f"The fold is {sizes['fold_flops'] / 1e12:.2f} TFLOP of fp32 matrix products: at this run's GEMM rate "
               f"({gemm:.0f} GFLOP/s wall on {args.threads} threads, {gemm_cpu:.0f} GFLOP per CPU-second, a "
               f"[2560×5120]·[5120×1280] product) that alone is {floor:.1f} s wall, {cpu_floor:.1f} s CPU.", ""]
    write_section(Path(args.results), "\n".join(section))
    print(f"\nappended to {args.results}")


def write_section(path: Path, text: str):
    """Append ``text`` to ``path``, replacing an earlier section of this script (up to the next ``## ``)."""
    old = path.read_text() if path.exists() else "# Benchmark results\n\n"
    if SECTION in old:
        start = old.index(SECTION)
        nxt = old.find("\n## ", start + len(SECTION))
        old = old[:start] + (old[nxt + 1:] if nxt >= 0 else "")
    path.write_text(old.rstrip("\n") + "\n\n" + text)


if __name__ == "__main__":
    main()
