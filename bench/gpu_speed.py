"""The GPU suite's speed parts: UNet forward latency in eager mode and as a CUDA-graph replay (the GPU's own time,
without Python's launch overhead), with the FLOPs of each model beside (``torch.utils.flop_counter``, as
``apps.fidelity.forward_flops`` counts them); and where slim layers lose time (``profile``: torch.profiler's
per-op device time, grouped by kind and by whether the op runs inside a slimmed site).

The storage forms that are the suite's own: :class:`Fp8Layer` (weights stored as float8_e4m3fn, cast to the
input's dtype in every forward, as UIs that "store fp8, compute fp16" do).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from core_bench import cpu_timer, interleaved_times
from gpu_parts import GIB, Context, latent, unet_config
from sdslim_core import layout
from sdslim_core.apps.fidelity import forward_flops
from sdslim_core.layout import rank_policy
from sdslim_core.modules import swap
from sdslim_core.modules.unet import build_diffusers_unet, canonical_shapes
from sdslim_core.vram import harness
from sdslim_core.vram.settings import ARCHS, Settings

RATIOS = (0.75, 0.5, 0.25)
ALIGN = 64                     # the rank-rounding candidate: ranks to multiples of this where the site allows
UNTILED = 5 / 16               # the fraction whose whole-group ranks miss the tensor-core tile: 100 at a 320-wide Res


class StoredLayer(nn.Module):
    """A Linear/Conv2d whose weight is held in another storage form (``weight_as`` makes the compute copy at each
    forward, dropped after it)."""

    def __init__(self, layer):
        super().__init__()
        self.bias = layer.bias
        self.conv = isinstance(layer, nn.Conv2d)
        if self.conv:
            self.stride, self.padding, self.dilation, self.groups = (layer.stride, layer.padding, layer.dilation,
                                                                     layer.groups)

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x):
        w = self.weight_as(x.dtype)
        if self.conv:
            return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return F.linear(x, w, self.bias)


class Fp8Layer(StoredLayer):
    """The weight stored as float8_e4m3fn and cast to the input's dtype in forward."""

    def __init__(self, layer):
        super().__init__(layer)
        self.register_buffer("weight", layer.weight.detach().to(torch.float8_e4m3fn))

    def weight_as(self, dtype):
        return self.weight.to(dtype)


def fp8_storage(model):
    """``model`` (changed in place) with every Linear/Conv2d as an :class:`Fp8Layer`; norms and biases stay."""
    for name, module in list(model.named_modules()):
        if isinstance(module, (nn.Linear, nn.Conv2d)) and getattr(module, "padding_mode", "zeros") == "zeros":
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, Fp8Layer(module))
    return model


def storage_bytes(model) -> int:
    """Bytes of all parameters and buffers (fp8 weights are buffers)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total




def model_inputs(cfg, side: int, batch: int, device: str):
    """fp16 (sample, timestep, context, extra kwargs) of one UNet call, from the harness's input maker."""
    s = Settings(arch=cfg.family if cfg.family in ARCHS else "sd15", resolution=side * 8, precision="fp32",
                 unet_config=dict(layout.diffusers_config(cfg)))
    torch.manual_seed(batch)
    x, t, context, extra = harness.step_inputs(None, s, batch, device, torch.float16)
    half = lambda d: {k: (v.half() if v.is_floating_point() else v) for k, v in d.items()}  # noqa: E731
    if "added_cond_kwargs" in extra:
        extra = {"added_cond_kwargs": half(extra["added_cond_kwargs"])}
    return x, t, context.half(), extra


def cuda_timer(fn) -> float:
    """Seconds of GPU time between two CUDA events around ``fn``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


class Replay:
    """A model's forward captured once in a CUDA graph on static inputs (after warm-up calls on a side stream);
    calling it replays the graph. On the CPU (dry run) it calls the model."""

    def __init__(self, model, inputs, cuda: bool):
        self.model, self.inputs, self.graph = model, inputs, None
        x, t, c, extra = inputs
        if not cuda:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                model(x, t, c, **extra)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = model(x, t, c, **extra)

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            x, t, c, extra = self.inputs
            self.model(x, t, c, **extra)


def _site_ranks(cfg, ranks: dict, multiple: int) -> dict:
    by_name = {s.name: s for s in layout.sites(canonical_shapes(cfg))}
    return {n: rank_policy.aligned_rank(by_name[n].width, r, by_name[n].kind, multiple) for n, r in ranks.items()}


def whole_group_ranks(cfg, ratio: float) -> dict:
    """Ranks at ``ratio`` rounded to whole norm2 groups only, without ``rank_policy``'s tensor-core tile (the rule
    before it: 5/16 of a 320-wide ResBlock is 100 channels, where the policy gives 80): the probe for what an
    untiled rank costs, beside ``slim 5/16`` (identical but at those sites)."""
    out = {}
    for s in layout.sites(canonical_shapes(cfg)):
        k = rank_policy.group_size(s.width) if s.kind == "res" else 1
        out[s.name] = min(s.width, k * max(1, round(s.width * ratio / k)))
    return out


def allocated_ranks(ctx: Context, cfg) -> tuple[dict | None, str]:
    """(ranks, where they come from): the allocation ``trainer_sd15`` made in this run (its default anchored
    allocation at ratio 0.5 on a random full-size teacher: the structure of an allocation, not a trained model's)."""
    rec = ctx.earlier("trainer_sd15")
    ranks = rec.get("ranks")
    if ranks and set(ranks) <= {s.name for s in layout.sites(canonical_shapes(cfg))}:
        return {k: int(v) for k, v in ranks.items()}, "trainer_sd15 in this run (anchored allocation, ratio 0.5)"
    return None, "no allocation: trainer_sd15 recorded none in this run"


def speed_models(family: str, ctx: Context) -> tuple:
    """(config, {name: module}, {name: note}): the original fp16 UNet (random weights, sdpa attention), its slim
    versions (uniform ratios; SD1.5 also the allocated ranks of this run's trainer and those ranks rounded to
    :data:`ALIGN`, and :data:`UNTILED` tiled vs whole groups only), fp8 storage of the original and of slim 0.5, and
    channels_last copies of both."""
    cfg = unet_config(family, ctx.dry)
    notes = {}
    torch.manual_seed(0)
    with torch.device(ctx.device):
        unet = build_diffusers_unet(cfg, device=ctx.device, dtype=torch.float16).eval()
        models = {"original": unet}
        for r in RATIOS:
            models[f"slim {r}"] = harness.slim_of(unet, r).eval()
        uniform = rank_policy.ranks_for_ratio(layout.sites(canonical_shapes(cfg)), 0.5)
        if family == "sd15":
            ranks, notes["allocated"] = allocated_ranks(ctx, cfg)
            if ranks:
                models["slim allocated"] = harness.slim_of(unet, None, ranks).eval()
                models[f"slim allocated r{ALIGN}"] = harness.slim_of(unet, None, _site_ranks(cfg, ranks, ALIGN)).eval()
            models["slim 5/16"] = harness.slim_of(unet, UNTILED).eval()
            models["slim 5/16 groups only"] = harness.slim_of(unet, None, whole_group_ranks(cfg, UNTILED)).eval()
        r25 = _site_ranks(cfg, rank_policy.ranks_for_ratio(layout.sites(canonical_shapes(cfg)), 0.25), ALIGN)
        models[f"slim 0.25 r{ALIGN}"] = harness.slim_of(unet, None, r25).eval()
        notes["uniform 0.5 ranks"] = "already multiples of 64 or of whole GroupNorm groups" \
            if _site_ranks(cfg, uniform, ALIGN) == uniform else "not aligned"
        models["original fp8"] = fp8_storage(copy_module(unet))
        models["slim 0.5 fp8"] = fp8_storage(copy_module(models["slim 0.5"]))
        models["original channels_last"] = copy_module(unet).to(memory_format=torch.channels_last)
        models["slim 0.5 channels_last"] = copy_module(models["slim 0.5"]).to(memory_format=torch.channels_last)
    for m in models.values():
        harness.set_attention(m, Settings(attention="sdpa"), None)
    return cfg, models, notes


def copy_module(m):
    import copy
    return copy.deepcopy(m)


def _inputs_for(name, inputs):
    x, t, c, extra = inputs
    if name.endswith("channels_last"):
        x = x.contiguous(memory_format=torch.channels_last)
    return x, t, c, extra


# the rows timed at B > 1 too (the storage and layout candidates are B = 1 only: the first H200 run's part cap left no
# time for B = 4 and 8 with every row)
AT_EVERY_BATCH = ("original", "slim 0.75", "slim 0.5", "slim 0.25")


def speed(ctx: Context, family: str) -> dict:
    """UNet forward latency, fp16, sdpa, per shape (SD1.5 512² B = 1, 4, 8; SDXL 1024² B = 1): eager (CUDA events,
    interleaved, median) and CUDA-graph replay (each model captured once per shape, replays interleaved, median),
    FLOPs of each model beside (counted once at B = 1: every term is linear in the batch), fp8's output error."""
    cfg, models, notes = speed_models(family, ctx)
    side = latent(family, ctx.dry)
    batches = (1, 4, 8) if family == "sd15" else (1,)
    cuda = ctx.device == "cuda"
    eager_n, graph_n, warmup = (2, 2, 1) if ctx.dry else (10, 20, 2)
    timer = cuda_timer if cuda else cpu_timer
    out = {"family": family, "dtype": "float16", "attention": "sdpa", "notes": notes,
           "timer": "cuda events" if cuda else "wall clock (dry run: CPU, no graphs)",
           "eager_repeats": eager_n, "graph_replays": graph_n, "shapes": {}, "flops": {}, "weight_gib": {}}
    one = model_inputs(cfg, side, 1, ctx.device)
    with torch.inference_mode():
        for name, m in models.items():
            x, t, c, extra = _inputs_for(name, one)
            out["flops"][name] = forward_flops(m, x, t, c, **extra)
            out["weight_gib"][name] = storage_bytes(m) / GIB
        ref = {k: models[k](*one[:3], **one[3]).sample.float() for k in ("original", "slim 0.5")}
        out["fp8_rel_err"] = {k: float((models[f"{k} fp8"](*one[:3], **one[3]).sample.float() - ref[k]).norm()
                                       / ref[k].norm()) for k in ref}
    ctx.partial(out)
    for batch in batches:
        key = f"{side * 8}px_b{batch}"
        if ctx.remaining() < (5 if ctx.dry else 4 + 2.5 * batch * (3 if family == "sdxl" else 1)):
            out["shapes"][key] = {"skipped": f"the part's time cap ({ctx.remaining():.0f} s left)"}
            continue
        inputs = model_inputs(cfg, side, batch, ctx.device)
        timed = models if batch == 1 else {k: m for k, m in models.items() if k in AT_EVERY_BATCH or
                                           k.startswith("allocated")}
        with torch.inference_mode():
            eager = interleaved_times(timed, lambda m: m(*_inputs_for(_name_of(timed, m), inputs)[:3],
                                                         **inputs[3]), eager_n, warmup, timer)
            replays = {name: Replay(m, _inputs_for(name, inputs), cuda) for name, m in timed.items()}
            graph = interleaved_times(replays, lambda r: r(), graph_n, 1, timer)
            del replays
        if cuda:
            torch.cuda.empty_cache()
        out["shapes"][key] = {"latent": side, "batch": batch, "models": _table(eager, graph, out["flops"])}
        ctx.partial(out)
        ctx.log(f"{family} {key}: " + ", ".join(f"{k} {v['graph_ms']:.2f} ms (x{v['graph_speedup']:.2f} of ideal "
                                                  f"x{v['ideal_speedup']:.2f})" for k, v in
                                                  out["shapes"][key]["models"].items()))
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    return out


def _name_of(models, m):
    return next(k for k, v in models.items() if v is m)


def _table(eager: dict, graph: dict, flops: dict) -> dict:
    e0, g0 = statistics.median(eager["original"]), statistics.median(graph["original"])
    out = {}
    for name in eager:
        e, g = statistics.median(eager[name]), statistics.median(graph[name])
        ideal = flops["original"] / flops[name]
        out[name] = {"eager_ms": e * 1e3, "graph_ms": g * 1e3, "eager_speedup": e0 / e, "graph_speedup": g0 / g,
                     "flops_ratio": flops[name] / flops["original"], "ideal_speedup": ideal,
                     "of_ideal": (g0 / g) / ideal}
    return out


# ------------------------------------------------------------------------------------------------ profile

KINDS = (("attention", ("scaled_dot_product", "flash", "efficient_attention", "fmha", "_attention")),
         ("norm", ("group_norm", "layer_norm")),
         ("GEMM/conv", ("conv", "mm", "linear", "matmul", "cudnn", "gemm")))
SITE_MARK = "sdslim.site"


def op_kind(name: str) -> str:
    """attention | norm | GEMM/conv | elementwise (everything else: adds, activations, copies, casts, concats)."""
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "elementwise"


def _mark_sites(unet, cfg):
    """Forward hooks that open a :data:`SITE_MARK` profiler range around every site's module; returns the
    handles."""
    handles = []
    for s in layout.sites(canonical_shapes(cfg)):
        module = unet.get_submodule(swap.site_path(unet, s.name, cfg))
        ranges = []
        handles.append(module.register_forward_pre_hook(
            lambda *_a, r=ranges: r.append(torch.profiler.record_function(SITE_MARK).__enter__())))
        handles.append(module.register_forward_hook(lambda *_a, r=ranges: r.pop().__exit__(None, None, None)))
    return handles


def grouped_times(prof, cuda: bool) -> dict:
    """{"site"|"other": {kind: ms}}: every op's own device time (CPU time in the dry run), by :func:`op_kind` and by
    whether a :data:`SITE_MARK` range encloses it."""
    out = {"site": {}, "other": {}}
    for evt in prof.events():
        own = (getattr(evt, "self_device_time_total", None) if cuda else evt.self_cpu_time_total) or 0
        if not own or evt.name == SITE_MARK or evt.name.startswith("ProfilerStep"):
            continue
        parent, in_site = evt.cpu_parent, False
        while parent is not None and not in_site:
            in_site, parent = parent.name == SITE_MARK, parent.cpu_parent
        where = out["site" if in_site else "other"]
        kind = op_kind(evt.name)
        where[kind] = where.get(kind, 0.0) + own / 1e3
    return out


def profile(ctx: Context) -> dict:
    """Where the time of SD1.5 512² B=1 goes, original vs slim 0.5 (and the candidates beside: channels_last, the
    0.25 ranks rounded to 64): torch.profiler's own device time per op, grouped into site vs other ×
    GEMM/conv, attention, norm, elementwise; the FLOPs beside."""
    from torch.profiler import ProfilerActivity
    cfg = unet_config("sd15", ctx.dry)
    cuda = ctx.device == "cuda"
    torch.manual_seed(0)
    with torch.device(ctx.device):
        unet = build_diffusers_unet(cfg, device=ctx.device, dtype=torch.float16).eval()
        models = {"original": unet, "slim 0.5": harness.slim_of(unet, 0.5).eval(),
                  "slim 0.25": harness.slim_of(unet, 0.25).eval()}
        models["slim 0.25 r64"] = harness.slim_of(unet, None, _site_ranks(cfg, rank_policy.ranks_for_ratio(
            layout.sites(canonical_shapes(cfg)), 0.25), ALIGN)).eval()
        models["original channels_last"] = copy_module(unet).to(memory_format=torch.channels_last)
        models["slim 0.5 channels_last"] = copy_module(models["slim 0.5"]).to(memory_format=torch.channels_last)
    for m in models.values():
        harness.set_attention(m, Settings(attention="sdpa"), None)
    inputs = model_inputs(cfg, latent("sd15", ctx.dry), 1, ctx.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {"shape": f"{latent('sd15', ctx.dry) * 8}px_b1", "time": "device (CUDA kernels)" if cuda else
           "CPU (dry run)", "models": {}}
    with torch.inference_mode():
        for name, m in models.items():
            x, t, c, extra = _inputs_for(name, inputs)
            for _ in range(2):
                m(x, t, c, **extra)
            handles = _mark_sites(m, cfg)
            try:
                with torch.profiler.profile(activities=activities) as prof:
                    for _ in range(3):
                        m(x, t, c, **extra)
                    if cuda:
                        torch.cuda.synchronize()
            finally:
                for h in handles:
                    h.remove()
            groups = {w: {k: v / 3 for k, v in d.items()} for w, d in grouped_times(prof, cuda).items()}
            out["models"][name] = {"ms": groups, "total_ms": sum(v for d in groups.values() for v in d.values()),
                                   "flops": forward_flops(m, x, t, c, **extra)}
            ctx.partial(out)
    base = out["models"]["original"]
    for name, rec in out["models"].items():
        rec["speedup"] = base["total_ms"] / rec["total_ms"]
        rec["ideal_speedup"] = base["flops"] / rec["flops"]
    return out


def speed_compile(ctx: Context) -> dict:
    """torch.compile (mode ``reduce-overhead``: CUDA graphs) of the SD1.5 original and slim 0.5 at 512² B=1: compile
    time and latency, beside the eager original (optional: ``--compile``)."""
    cfg, eager, _ = speed_models("sd15", ctx)
    x, t, context, extra = model_inputs(cfg, latent("sd15", ctx.dry), 1, ctx.device)

    def call(m):
        return m(x, t, context, **extra)
    models, compile_s = {"original (eager)": eager["original"]}, {}
    with torch.no_grad():   # inference_mode tensors and dynamo's guards do not mix everywhere
        for name in ("original", "slim 0.5"):
            m = torch.compile(eager[name], mode="reduce-overhead" if ctx.device == "cuda" else "default")
            t0 = time.time()
            for _ in range(3):
                call(m)
            if ctx.device == "cuda":
                torch.cuda.synchronize()
            compile_s[name] = time.time() - t0
            models[f"{name} (compiled)"] = m
            ctx.partial({"compile_s": compile_s})
        times = interleaved_times(models, call, 3 if ctx.dry else 20, 2, cuda_timer if ctx.device == "cuda"
                                  else cpu_timer)
    base = statistics.median(times["original (compiled)"])
    return {"compile_s": compile_s, "models": {k: {"median_ms": statistics.median(v) * 1e3,
                                                   "speedup_vs_compiled_original": base / statistics.median(v)}
                                               for k, v in times.items()}}
