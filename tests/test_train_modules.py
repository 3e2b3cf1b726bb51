"""Trainer building blocks on the tiny SD-layout UNet: gates, per-site students, calibration capture,
initialisation quality, rank allocation and checkpoint files."""
import json
import math

import pytest
import torch

from conftest import randomize_, tiny_config
from sdslim_core import layout
from sdslim_core.apps.breakdown import canonical_shapes_for_arch
from sdslim_core.io import adapters
from sdslim_core.layout import rank_policy
from sdslim_core.modules import swap
from sdslim_core.modules.unet import build_diffusers_unet
from sdslim_core.train import calibration as cal, checkpoint, ranks as ranks_mod
from sdslim_core.train.config import TrainConfig, parse_budget
from sdslim_core.train.init import SiteInit
from sdslim_core.train.sites import FeatureRecorder, SiteData, gated_tree, set_gates, site_module

NULL = __import__("contextlib").nullcontext



def _canon(unet):
    canon, _, _ = layout.to_canonical(unet.state_dict())
    return canon


def _perturbed(canon, ratio=0.5, seed=1):
    site_list = layout.sites(canon)
    aset = adapters.AdapterSet.init_select(canon, rank_policy.ranks_for_ratio(site_list, ratio), "sd15")
    g = torch.Generator().manual_seed(seed)
    for t in aset.sites.values():
        for k, v in t.items():
            t[k] = (v + 0.2 * torch.randn(v.shape, generator=g, dtype=torch.float64)).to(v.dtype)
    return aset


def _inputs(cfg, dtype, seed=3, batch=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, cfg.in_channels, 8, 8, generator=g, dtype=dtype), torch.tensor([10.0, 700.0])[:batch],
            torch.randn(batch, 5, cfg.context_dim, generator=g, dtype=dtype))


@pytest.fixture(scope="module")
def unet64():
    torch.manual_seed(0)
    return randomize_(build_diffusers_unet(tiny_config(), dtype=torch.float64)).eval()


def test_gates_off_reproduce_teacher_exactly_and_on_match_attach_train_adapters(unet64):
    cfg = tiny_config()
    aset = _perturbed(_canon(unet64))
    x, t, ctx = _inputs(cfg, torch.float64)
    with torch.no_grad():
        teacher = unet64(x, t, encoder_hidden_states=ctx).sample
        tree, _, gates = gated_tree(unet64, aset, cfg)
        set_gates(gates, False)
        assert torch.equal(tree(x, t, encoder_hidden_states=ctx).sample, teacher)
        set_gates(gates, True)
        gated = tree(x, t, encoder_hidden_states=ctx).sample
        reference, _ = swap.attach_train_adapters(unet64, aset)
        ref = reference(x, t, encoder_hidden_states=ctx).sample
    assert torch.equal(gated, ref)
    assert (gated - teacher).norm() / teacher.norm() > 1e-3          # the students really differ
    # mixed: replacing one site changes the output, the teacher tree itself is untouched
    with torch.no_grad():
        set_gates(gates, {s: s == "input_blocks.1.0" for s in gates})
        one = tree(x, t, encoder_hidden_states=ctx).sample
        assert not torch.equal(one, teacher) and not torch.equal(one, ref)
        assert torch.equal(unet64(x, t, encoder_hidden_states=ctx).sample, teacher)


def test_site_student_equals_the_site_inside_attach_train_adapters(unet64):
    cfg = tiny_config()
    aset = _perturbed(_canon(unet64))
    tree, site_adapters = swap.attach_train_adapters(unet64, aset)
    g = torch.Generator().manual_seed(5)
    for site in ("input_blocks.4.1.transformer_blocks.0.ff", "output_blocks.3.0", "middle_block.0"):
        kind = aset.kind(site)
        teacher_site = site_module(unet64, site, cfg)
        tensors = {k: v.double() for k, v in aset.sites[site].items()}
        student, _ = swap.train_site(teacher_site, site, kind, "diffusers", tensors, aset.groups(site))
        other = site_module(tree, site, cfg)
        with torch.no_grad():
            if kind == "ff":
                x = torch.randn(3, 7, teacher_site.net[0].proj.in_features, generator=g, dtype=torch.float64)
                a, b = student(x), other(x)
            else:
                x = torch.randn(2, teacher_site.conv1.in_channels, 4, 4, generator=g, dtype=torch.float64)
                e = torch.randn(2, teacher_site.time_emb_proj.in_features, generator=g, dtype=torch.float64)
                a, b = student(x, e), other(x, e)
        assert torch.allclose(a, b, rtol=0, atol=1e-12), site


def test_feature_loss_and_gradient_checkpointing_give_the_same_gradients():
    torch.manual_seed(0)
    cfg = tiny_config()
    unet = build_diffusers_unet(cfg).eval()
    aset = _perturbed(_canon(unet))
    x, t, ctx = _inputs(cfg, torch.float32, batch=1)
    grads = []
    for ckpt in (False, True):
        tree, site_adapters, gates = gated_tree(unet, aset, cfg)
        tree.requires_grad_(False)
        for a in site_adapters.values():
            a.requires_grad_(True)
        if ckpt:
            tree.enable_gradient_checkpointing()
        rec = FeatureRecorder()
        for gate in gates.values():
            gate.feature = rec
        rec.start()
        out = tree(x, t, encoder_hidden_states=ctx).sample
        rec.stop()
        losses = rec.losses()
        assert len(losses) == len(gates) and all(v > 0 for v in losses)
        (out.pow(2).mean() + torch.stack(losses).mean()).backward()
        assert len(rec.pairs) == len(gates)                      # recomputation did not record again
        grads.append(torch.cat([p.grad.flatten() for a in site_adapters.values() for p in a.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------------------------- calibration

@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """A float32 tiny teacher, a small calibration (CFG trajectories) and its captured site activations."""
    torch.manual_seed(0)
    cfg = tiny_config()
    unet = build_diffusers_unet(cfg).eval().requires_grad_(False)
    ctx = torch.randn(3, 6, cfg.context_dim, generator=torch.Generator().manual_seed(1))
    calib = cal.Calibration.from_contexts(ctx)
    tc = TrainConfig(n_trajectories=8, sample_steps=6, guidance=3.0, latent_size=8, res_maps=64, ff_inputs=64)
    bank = cal.build_inputs(unet, cfg, calib, tc, "cpu", torch.float32, 8, NULL)
    store = cal.ActivationStore(tmp_path_factory.mktemp("calib"), ram_budget=2e5)   # tiny budget: many shards
    site_list = layout.sites(_canon(unet))
    cal.capture_sites(unet, cfg, bank, site_list, tc, store, "cpu", torch.float32, NULL)
    return dict(unet=unet, cfg=cfg, bank=bank, store=store, tc=tc, site_list=site_list)


def test_calibration_records_the_teachers_own_trajectories(captured):
    bank, unet = captured["bank"], captured["unet"]
    tc = captured["tc"]
    assert len(bank) == tc.n_trajectories * tc.sample_steps * 2          # CFG: uncond + cond rows
    assert bank.is_eval.any() and (~bank.is_eval).any()
    for g in bank.group.unique():                                          # split by whole trajectories
        assert bank.is_eval[bank.group == g].unique().numel() == 1
    assert (bank.ctx == bank.contexts.shape[0] - 1).sum() == len(bank) // 2   # half are unconditional rows
    ids = torch.tensor([0, len(bank) - 1])
    with torch.no_grad():
        eps = cal.unet_call(unet, bank.batch(ids))
    assert torch.allclose(eps, bank.eps[ids], atol=1e-5)                  # recorded outputs are the teacher's


def test_activation_store_shards_and_reads_back_sites(captured):
    store, site_list = captured["store"], captured["site_list"]
    assert len(store.shards) > 1                                          # the RAM budget forced several shards
    ff = next(s for s in site_list if s.kind == "ff")
    res = next(s for s in site_list if s.kind == "res")
    f = store.site(ff.name, "fit")
    assert f["x"].ndim == 2 and f["x"].shape[1] == ff.in_dim and f["x"].shape[0] > 100
    r = store.site(res.name, "eval")
    assert r["x"].ndim == 4 and r["emb"].shape == (r["x"].shape[0], res.emb_dim)
    reopened = cal.ActivationStore.open(store.folder, store.manifest())
    assert torch.equal(reopened.site(ff.name, "fit")["x"], f["x"])


def _site_init(captured, name):
    site = next(s for s in captured["site_list"] if s.name == name)
    mod = site_module(captured["unet"], name, captured["cfg"])
    store = captured["store"]
    data = SiteData(name, site.kind, store.site(name, "fit"), store.site(name, "eval"), mod, "cpu", torch.float32,
                    NULL, batch=4096 if site.kind == "ff" else 8)
    return SiteInit(site, mod, "diffusers", data, _canon(captured["unet"]), "sd15", "cpu", torch.float32, NULL)


@pytest.mark.parametrize("name", ["input_blocks.1.1.transformer_blocks.0.ff", "output_blocks.5.1.transformer_blocks.0.ff",
                                  "input_blocks.2.0", "output_blocks.4.0"])
def test_activation_aware_init_beats_random_init_widely(captured, name):
    si = _site_init(captured, name)
    r = si.site.width // 2
    _, chosen, errors = si.best(r, ("act_select", "act_pca", "weight_svd", "select", "random"))
    assert chosen != "random"
    assert errors[chosen] < 0.6 * errors["random"], errors
    assert errors["act_select"] <= errors["weight_svd"], errors           # the weak baseline is beaten
    assert all(math.isfinite(e) for e in errors.values())


def test_full_rank_selection_init_is_exact(captured):
    for name in ("input_blocks.1.1.transformer_blocks.0.ff", "output_blocks.4.0"):
        si = _site_init(captured, name)
        t = si.tensors("act_select", si.site.width)
        assert si.error(t, si.site.width) < 1e-5


def test_error_vs_rank_curve_falls(captured):
    si = _site_init(captured, "output_blocks.5.1.transformer_blocks.0.ff")
    curve = si.curve([32, 96, 192])
    assert curve[32] > curve[96] > curve[192]


# --------------------------------------------------------------------------------------------------- ranks

def test_parse_budget():
    assert parse_budget("600M") == ("params", 6e8, 600_000_000)
    assert parse_budget("1.2GB")[2] == 600_000_000                       # fp16: 2 bytes per parameter
    assert parse_budget("1GiB", 4)[2] == 2 ** 30 // 4
    assert parse_budget(12345)[2] == 12345
    for bad in ("1.2B", "abc", "-5M", "3 parsecs"):
        with pytest.raises(ValueError):
            parse_budget(bad)


def test_ratio_ranks_overrides_and_groups():
    shapes = {k: tuple(v.shape) for k, v in _canon(build_diffusers_unet(tiny_config(), device="meta")).items()}
    site_list = layout.sites(shapes)
    r = ranks_mod.ratio_ranks(site_list, TrainConfig(ff_rank=48, res_ratio=0.25))
    for s in site_list:
        if s.kind == "ff":
            assert r[s.name] == 48
        else:
            assert r[s.name] == max(1, round(s.width * 0.25))
            assert r[s.name] % rank_policy.norm_groups_for(r[s.name]) == 0
    only_ff = ranks_mod.ratio_ranks(site_list, TrainConfig(ff_ratio=0.5))
    assert {layout.site_kind(s) for s in only_ff} == {"ff"}
    with pytest.raises(ValueError):
        TrainConfig(ratio=0.5, budget="1M")


@pytest.mark.parametrize("arch", ["sd15", "sd2", "sdxl"])
def test_every_candidate_rank_of_a_real_unet_is_tensor_core_tiled_and_whole_groups(arch):
    """Guards GPU time: the allocator picks ranks from this grid, and a 320-wide ResBlock at 1/16, 3/16, 5/16 of its
    width used to get 20/60/100 channels (whole groups of 10, but not the multiples of 8 fp16 tensor cores take).
    Every default grid rank, and the ranks of other ratios, of SD1.5/SD2/SDXL is a multiple of 8 and, for Res, of
    the site's norm2 group size; the grid still offers at least 7 ranks at every site."""
    shapes, _ = canonical_shapes_for_arch(arch)
    for site in layout.sites(shapes):
        grid = ranks_mod.rank_grid(site, TrainConfig().rank_grid + (0.3, 0.33, 0.6))
        assert len(grid) >= 7, (site.name, grid)
        for r in grid:
            assert r % 8 == 0, (site.name, r)
            if site.kind == "res":
                assert r % rank_policy.group_size(site.width) == 0, (site.name, r)
    res320 = next(s for s in layout.sites(shapes) if s.kind == "res" and s.width == 320)
    assert ranks_mod.rank_grid(res320, TrainConfig().rank_grid) == [40, 80, 120, 160, 200, 240, 280]


def test_narrow_widths_keep_the_fine_rank_grid():
    """Tiling applies only where a width holds 8 steps of it: 32-wide blocks (the tiny test models') keep ranks in
    single channels, where an 8-channel step would leave three candidate ranks."""
    assert rank_policy.rank_step(32, "res") == 1 and rank_policy.rank_for_ratio(32, 3 / 16, "res") == 6
    assert rank_policy.rank_step(64, "res") == 8 and rank_policy.rank_step(320, "res") == 40
    assert rank_policy.rank_step(1280, "ff") == 8 and rank_policy.rank_for_ratio(1280, 0.33, "ff") == 424
    assert rank_policy.rank_step(48, "ff") == 1 and rank_policy.rank_for_ratio(48, 0.5, "ff") == 24


def test_a_damaged_rank_allocation_names_the_work_folder_in_words_every_host_can_act_on(tmp_path):
    """A resumed run (the hosts resume automatically) whose ranks.json is damaged: the error names the file and the
    work folder to delete, not only the CLI's --resume."""
    from types import SimpleNamespace
    (tmp_path / "ranks.json").write_text('{"ranks": {"a": ')
    session = SimpleNamespace(work_dir=tmp_path, resume=True, say=print)
    with pytest.raises(ValueError, match=r"ranks\.json is damaged .*delete the work folder .*" + tmp_path.name):
        ranks_mod._recorded(session)


def test_the_8gb_check_picks_the_fewest_stage2_groups_that_fit_and_names_the_device_that_would(monkeypatch):
    """``device_fit`` on SDXL's real sites at uniform 0.5, with the estimator's numbers given: here stage 2's
    reserve is linear in the trained group's adapter parameters (states and buffers: ``per`` GiB each, on a fixed
    ``floor``), so the check, which estimates all-in-one and the largest of 8 groups and places the others between,
    must give every g exactly the reserve of the largest group ``split_groups`` makes; it picks the fewest groups
    that fit, or says which phase is over and the device size the run needs."""
    from types import SimpleNamespace
    from sdslim_core.train import device_fit as fit_mod, stage2
    shapes, cfg = canonical_shapes_for_arch("sdxl")
    site_list = layout.sites(shapes)
    ranks = rank_policy.ranks_for_ratio(site_list, 0.5)
    session = SimpleNamespace(site_list=site_list, site_order=[s.name for s in site_list], cfg=cfg,
                              tc=TrainConfig(), latent_size=128, device=torch.device("cpu"), optimizer_name="adamw8bit")
    size = {s.name: ranks_mod.adapter_param_count([s], ranks) for s in site_list}
    per = 13 / 2 ** 30                                   # more than the 10 B/param of the states alone

    def reserve(floor, sites):
        return floor + per * sum(size[s] for s in sites)

    for calib, floor, device in ((3.0, 6.0, 8.0), (3.0, 6.0, 24.0), (9.0, 6.0, 8.0), (3.0, 0.5, 8.0)):
        def predict(*a, train_sites=None, **k):
            r = reserve(floor, train_sites or size)
            est = {"stage2": {"reserved_gib": r, "peak_gib": r}, "calibration": {"reserved_gib": calib,
                                                                               "peak_gib": calib}}
            return {"peak_gib": 1.0, "estimator": est, "stages_gib": {"stage1": 2.0}}
        monkeypatch.setattr(fit_mod, "predict", predict)
        got = fit_mod.device_fit(session, ranks, device, context_gib=1.0, optimizer="adamw8bit")
        peaks = {g: reserve(floor, max(stage2.split_groups(session.site_order, size, g),
                                       key=lambda grp: sum(size[s] for s in grp))) + 1.0
                 for g in range(1, fit_mod.MAX_GROUPS + 1)}
        assert all(abs(got["stage2_gib_by_groups"][g] - peaks[g]) < 1e-6 for g in peaks), (got, peaks)
        fixed = max(calib, 2.0) + 1.0
        fits = [g for g in peaks if max(peaks[g], fixed) <= device]
        assert got["groups"] == (fits[0] if fits else None)
        if not fits:
            assert abs(got["needs_gib"] - max(fixed, min(peaks.values()))) < 1e-6
            assert f"needs a device of {got['needs_gib']:.1f} GiB" in got["text"]
            assert ("calibration alone needs" in got["text"]) == (fixed > device)
        else:
            assert got["text"].startswith(f"fits {device:g} GiB with --stage2-groups {fits[0]}")


def test_auto_stage2_groups_on_cuda_are_the_checks_fewest_that_fit_this_gpu(monkeypatch):
    """On CUDA, ``stage2_groups=auto`` is what the check ``--plan-only`` prints says for this GPU (its memory, its
    context now): the fewest groups whose stage-2 device peak fits, by the same linear reserve as above (calibration
    is behind the run by then, so only stage 2 counts); the fewest at the lowest peak when none fits, said; the
    memory rule where the estimator gives nothing; the estimator once per ranks."""
    from types import SimpleNamespace
    from sdslim_core.train import device_fit as fit_mod, stage2
    shapes, cfg = canonical_shapes_for_arch("sdxl")
    site_list = layout.sites(shapes)
    ranks = rank_policy.ranks_for_ratio(site_list, 0.5)
    size = {s.name: ranks_mod.adapter_param_count([s], ranks) for s in site_list}
    per, context = 13 / 2 ** 30, 1.0
    calls = []

    def largest(g):
        return max(stage2.split_groups([s.name for s in site_list], size, g), key=lambda grp: sum(size[s] for s in grp))

    for floor, device in ((6.0, 40.0), (6.0, 14.0), (6.0, 8.0), (None, 12.0)):
        def predict(*a, train_sites=None, **k):
            calls.append(1)
            if floor is None:
                return {"peak_gib": None, "text": "VRAM estimator failed (stub)"}
            r = floor + per * sum(size[s] for s in (train_sites or size))
            est = {"stage2": {"reserved_gib": r, "peak_gib": r}, "calibration": {"reserved_gib": 9.0, "peak_gib": 9.0}}
            return {"peak_gib": 1.0, "estimator": est, "stages_gib": {"stage1": 2.0}}
        monkeypatch.setattr(fit_mod, "predict", predict)
        monkeypatch.setattr(fit_mod, "default_device_gib", lambda d, device=device: device)
        monkeypatch.setattr(fit_mod, "measured_context_gib", lambda d: context)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda d, device=device: SimpleNamespace(total_memory=int(device * 2 ** 30)))
        said = []
        session = SimpleNamespace(site_list=site_list, site_order=[s.name for s in site_list], cfg=cfg, shapes=shapes,
                                  tc=TrainConfig(), latent_size=128, device=torch.device("cuda"),
                                  teacher_dtype=torch.float16, optimizer_name="adamw8bit", say=said.append,
                                  placement=SimpleNamespace(offload=False))
        calls.clear()
        n = stage2.resolve_groups(session, ranks)
        first = len(calls)
        assert stage2.resolve_groups(session, ranks) == n and len(calls) == first <= 2
        shown = fit_mod.own_device_fit(session, ranks)           # what --plan-only prints: the same check, not rerun
        assert len(calls) == first and shown["device_gib"] == device and shown["context_gib"] == context
        if floor is None:                  # the rule: adapters + grads + 8-bit states + bf16 copies beside the teacher
            room = 0.92 * device * 2 ** 30 - 2 * ranks_mod.param_count(shapes) - 1.5 * 2 ** 30
            assert n == math.ceil(sum(size.values()) * 12 / room) > 1
            assert said[0].startswith("stage 2 groups by the memory rule (") and "failed (stub)" in said[0]
            continue
        peaks = {g: floor + per * sum(size[s] for s in largest(g)) + context for g in range(1, fit_mod.MAX_GROUPS + 1)}
        fits = [g for g in peaks if peaks[g] <= device]
        assert n == (fits[0] if fits else fit_mod.MAX_GROUPS), (n, peaks)
        assert said == [f"stage 2 in {n} group{'s' if n > 1 else ''}: predicted device peak {peaks[n]:.2f} GiB of "
                        f"this GPU's {device:.2f} GiB (its context now {context:.2f} GiB)"
                        + ("" if fits else "; more than it has: stage 2 may run out of memory")]
    assert 6.0 + per * sum(size.values()) + context <= 40.0        # the cases: one group, 5 groups, none fits


def test_offloading_the_teacher_is_offered_where_nothing_fits_and_auto_takes_it_only_then(monkeypatch):
    """Where no stage-2 split fits with the teacher on the device, the check adds what offloading it gives (the
    estimator run with the teacher offloaded: here its 4.8 GiB leave every phase), and ``offload_teacher=auto`` on
    CUDA offloads exactly then (when it fits, or needs less), stage 2's groups then coming from the offloaded check;
    on/off are taken as said without an estimate, and a CPU run never offloads."""
    from types import SimpleNamespace
    from sdslim_core.train import device_fit as fit_mod, stage2
    from sdslim_core.train.teacher import TeacherPlacement
    shapes, cfg = canonical_shapes_for_arch("sdxl")
    site_list = layout.sites(shapes)
    ranks = rank_policy.ranks_for_ratio(site_list, 0.5)
    size = {s.name: ranks_mod.adapter_param_count([s], ranks) for s in site_list}
    per, context, teacher = 13 / 2 ** 30, 1.0, 4.8
    calls = []

    def predict(*a, train_sites=None, offload=False, **k):
        calls.append(offload)
        t = 0.0 if offload else teacher
        r = 1.0 + t + per * sum(size[s] for s in (train_sites or size))
        est = {"stage2": {"reserved_gib": r, "peak_gib": r}, "calibration": {"reserved_gib": 3.0 + t, "peak_gib": 3.0}}
        return {"peak_gib": 1.0, "estimator": est, "stages_gib": {"stage1": 2.0 + t}}
    monkeypatch.setattr(fit_mod, "predict", predict)
    monkeypatch.setattr(fit_mod, "measured_context_gib", lambda d: context)

    def largest(g):
        return max(stage2.split_groups([s.name for s in site_list], size, g), key=lambda grp: sum(size[s] for s in grp))

    def session_for(device, want="auto", kind="cuda"):
        monkeypatch.setattr(fit_mod, "default_device_gib", lambda d: device)
        return SimpleNamespace(site_list=site_list, site_order=[s.name for s in site_list], cfg=cfg, shapes=shapes,
                               tc=TrainConfig(offload_teacher=want), latent_size=128, device=torch.device(kind),
                               teacher_dtype=torch.float16, optimizer_name="adamw8bit", say=said.append,
                               topo=SimpleNamespace(main=True, broadcast_object=lambda x: x),
                               placement=TeacherPlacement(torch.nn.Linear(2, 2), cfg, torch.device(kind)))
    cases = []
    for device in (24.0, 8.0, 3.0):
        said, peaks = [], {}
        for t in (teacher, 0.0):
            peaks[t] = {g: 1.0 + t + per * sum(size[s] for s in largest(g)) + context for g in range(1, 9)}
        fixed = {t: max(3.0, 2.0) + t + context for t in (teacher, 0.0)}
        fits = {t: [g for g in peaks[t] if max(peaks[t][g], fixed[t]) <= device] for t in peaks}
        cases.append((bool(fits[teacher]), bool(fits[0.0])))
        session = session_for(device)
        calls.clear()
        offloaded = fit_mod.place_teacher(session, ranks)
        assert offloaded == session.placement.offload == (not fits[teacher])
        fit = fit_mod.own_check(session, ranks)
        assert set(calls) == ({False} if fits[teacher] else {False, True})            # the check ran once each
        if fits[teacher]:
            assert "offloaded" not in fit and not said and stage2.resolve_groups(session, ranks) == fits[teacher][0]
            continue
        off = fit["offloaded"]
        assert off["groups"] == (fits[0.0][0] if fits[0.0] else None)
        assert fit["text"].split("\n")[1].startswith(
            f"with the teacher offloaded: fits {device:g} GiB with --offload-teacher on and --stage2-groups "
            f"{fits[0.0][0]};" if fits[0.0] else f"with the teacher offloaded: does not fit {device:g} GiB")
        assert said[0].startswith("the teacher is offloaded (")
        n = stage2.resolve_groups(session, ranks)
        assert n == (fits[0.0][0] if fits[0.0] else off["needs_groups"]) and set(calls) == {False, True}
    assert cases == [(True, True), (False, True), (False, False)]     # fits whole, offloaded only, neither
    for want, kind in ((True, "cuda"), (False, "cuda"), ("auto", "cpu")):
        said, session = [], session_for(3.0, want, kind)
        calls.clear()
        assert fit_mod.place_teacher(session, ranks) == (want is True) and not calls


def test_plan_only_checks_the_cuda_devices_own_memory_by_default(monkeypatch):
    """On a CUDA run --plan-only's check is for the card the user has (a 6 GB card is told about 6 GiB, not 8), with
    what that card holds outside torch now as its context; on the CPU there is no check unless --fit-gib asks."""
    from types import SimpleNamespace
    from sdslim_core.train import device_fit as fit_mod
    seen = []

    def props(device):
        seen.append(device)
        return SimpleNamespace(total_memory=6 * 2 ** 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert fit_mod.default_device_gib("cuda:1") == 6.0 and seen == [torch.device("cuda:1")]
    assert fit_mod.default_device_gib(torch.device("cpu")) == 0.0
    # and its context as it is: everything the GPU holds beyond this process's torch reserve (other programs too)
    from sdslim_core.vram import live
    monkeypatch.setattr(live, "device_used", lambda index: {1: 3 * 2 ** 30}.get(index))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: {1: 2 ** 30}[index])
    assert fit_mod.measured_context_gib("cuda:1") == 2.0
    monkeypatch.setattr(live, "device_used", lambda index: None)
    assert fit_mod.measured_context_gib("cuda:1") is None and fit_mod.measured_context_gib("cpu") is None


def test_budget_allocation_spends_where_error_falls_fastest():
    shapes = {k: tuple(v.shape) for k, v in _canon(build_diffusers_unet(tiny_config(), device="meta")).items()}
    site_list = [s for s in layout.sites(shapes) if s.kind == "ff"][:2]
    a, b = site_list
    grid = {s.name: ranks_mod.rank_grid(s, (0.25, 0.5, 0.75)) for s in site_list}
    # site a: error barely moves with rank; site b: error drops steeply
    curves = {a.name: {r: 0.5 - 0.01 * i for i, r in enumerate(grid[a.name])},
              b.name: {r: 0.9 - 0.3 * i for i, r in enumerate(grid[b.name])}}
    full = ranks_mod.slim_param_count(shapes, {})
    floor = ranks_mod.slim_param_count(shapes, {s.name: grid[s.name][0] for s in site_list})
    step_b = ranks_mod.params_per_rank(shapes, b) * (grid[b.name][1] - grid[b.name][0])
    ranks, info = ranks_mod.allocate(site_list, shapes, curves, floor + step_b)
    assert ranks[b.name] == grid[b.name][1] and ranks[a.name] == grid[a.name][0]
    assert info["slim_params"] == ranks_mod.slim_param_count(shapes, ranks) <= floor + step_b
    ranks, _ = ranks_mod.allocate(site_list, shapes, curves, full)       # enough for everything: nothing slimmed
    assert ranks == {}
    with pytest.raises(ValueError, match="below the smallest"):
        ranks_mod.allocate(site_list, shapes, curves, floor - 1)


# ---------------------------------------------------------------------------------------------- checkpoints

def test_checkpoint_roundtrip_keeps_optimizer_and_rng(tmp_path):
    import random
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.randn(4, 3)
    opt.step()
    t, meta = checkpoint.optimizer_tensors(opt)
    random.seed(7)
    torch.manual_seed(7)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, "s2", step, dict(t, **{"adapter/w": p}), {"step": step, "optimizer": meta}, keep=2)
    assert sorted(f.name for f in tmp_path.glob("*.safetensors")) == ["s2-000000002.safetensors",
                                                                       "s2-000000003.safetensors"]
    expect_torch, expect_py = torch.rand(3), random.random()
    tensors, state, path = checkpoint.latest(tmp_path, "s2")
    assert state["step"] == 3 and torch.equal(tensors["adapter/w"], p.detach())
    opt2 = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())], lr=1e-2)
    checkpoint.load_optimizer(opt2, tensors, state["optimizer"])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    checkpoint.set_rng_state(tensors, state["rng"])
    assert torch.equal(torch.rand(3), expect_torch) and random.random() == expect_py
    # damage the newest file: a clear error naming the previous checkpoint, which stays
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(checkpoint.CheckpointError, match="s2-000000002"):
        checkpoint.latest(tmp_path, "s2")
    assert (tmp_path / "s2-000000002.safetensors").exists()
    path.write_bytes(bytes(raw[:100]))                                   # truncated
    with pytest.raises(checkpoint.CheckpointError, match="corrupt checkpoint"):
        checkpoint.latest(tmp_path, "s2")


class NestedStateAdamW(torch.optim.AdamW):
    """AdamW whose ``state_dict`` nests part of each parameter's state in a dict, as bitsandbytes' 8-bit optimizers
    do from 0.45 on (their quantisation state under one key, hidden from FSDP); ``load_state_dict`` undoes it."""
    KEY = "__wrapped_quant_state__"

    def state_dict(self):
        sd = super().state_dict()
        sd["state"] = {i: {k: v for k, v in st.items() if k != "exp_avg_sq"} | {self.KEY: {
            "exp_avg_sq": st["exp_avg_sq"], "note": "kept"}} for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, sd):
        sd = dict(sd, state={i: {k: v for k, v in st.items() if k != self.KEY} | {
            "exp_avg_sq": st[self.KEY]["exp_avg_sq"]} for i, st in sd["state"].items()})
        super().load_state_dict(sd)


def test_an_optimizer_state_with_nested_tensors_round_trips_as_bitsandbytes_keeps_it(tmp_path):
    """The first GPU run: every CUDA training with bitsandbytes 0.50 stopped at its first checkpoint ("Object of
    type Tensor is not JSON serializable"): the 8-bit state is a dict of tensors inside the parameter's state."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = NestedStateAdamW([p], lr=1e-2)
    p.grad = torch.randn(4, 3)
    opt.step()
    t, meta = checkpoint.optimizer_tensors(opt)
    checkpoint.save(tmp_path, "s1", 1, dict(t, **{"adapter/w": p}), {"step": 1, "optimizer": meta})
    tensors, state, _ = checkpoint.latest(tmp_path, "s1")
    opt2 = NestedStateAdamW([torch.nn.Parameter(p.detach().clone())], lr=1e-2)
    checkpoint.load_optimizer(opt2, tensors, state["optimizer"])
    a, b = opt.state_dict()["state"][0], opt2.state_dict()["state"][0]
    assert torch.equal(a[opt.KEY]["exp_avg_sq"], b[opt.KEY]["exp_avg_sq"]) and b[opt.KEY]["note"] == "kept"
    assert torch.equal(a["exp_avg"], b["exp_avg"])


# ------------------------------------------------------------------------------------- CLI and VRAM factory

def test_cli_budget_run_on_the_shipped_tiny_checkpoint(tmp_path, capsys):
    from sdslim_core import cli, tiny
    from sdslim_core.io.adapters import AdapterSet
    out = tmp_path / "a.safetensors"
    code = cli.main(["train", "--ckpt", str(tiny.DEFAULT_PATH), "--out", str(out), "--budget", "2.4M",
                     "--steps", "0", "--trajectories", "3", "--sample-steps", "2", "--guidance", "4",
                     "--prompt", "a red circle on a blue background", "--prompt", "a green square on a white background",
                     "--no-vram-estimate", "--no-progress", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["budget"]["budget_params"] == 2_400_000
    assert report["params"]["slim"] <= 2_400_000 < report["params"]["original"]
    assert report["calibration"]["source"] == "prompts" and report["calibration"]["n_prompts"] == 2
    aset = AdapterSet.load(out)
    assert set(aset.site_errors()) == set(aset.sites) and len(set(aset.ranks().values())) > 2   # ranks differ
    for site in aset.sites:
        if aset.kind(site) == "res":
            assert aset.rank(site) % aset.groups(site) == 0
    assert aset.metadata["sdslim.train"]["ranks"]["budget"] == "2.4M"


def test_cli_errors_are_clear(tmp_path, capsys):
    from sdslim_core import cli
    ckpt = tmp_path / "unet.safetensors"
    from safetensors.torch import save_file
    unet = build_diffusers_unet(tiny_config())
    save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, str(ckpt))
    code = cli.main(["train", "--ckpt", str(ckpt), "--out", str(tmp_path / "a.safetensors"), "--prompt", "a cat",
                     "--no-vram-estimate"])
    assert code == 2 and "--embeddings" in capsys.readouterr().err


def test_vram_estimator_model_is_the_stage2_module(monkeypatch):
    from sdslim_core.train import vram
    from sdslim_core.train.sites import SiteGate
    from sdslim_core.vram.settings import Settings
    cfg = tiny_config()
    shapes = {k: tuple(v.shape) for k, v in _canon(build_diffusers_unet(cfg, device="meta")).items()}
    ranks = rank_policy.ranks_for_ratio(layout.sites(shapes), 0.5)
    monkeypatch.setenv(vram._ENV, json.dumps(ranks))
    with torch.device("meta"):
        tree = vram.estimator_model(Settings(unet_config=layout.diffusers_config(cfg), resolution=64))
    gates = [m for m in tree.modules() if isinstance(m, SiteGate)]
    assert len(gates) == len(ranks)
    trainable = sum(p.numel() for p in tree.parameters() if p.requires_grad)
    assert trainable == vram.adapter_param_count(layout.sites(shapes), ranks)
    # the frozen teacher once, as the trainer holds it (the gates' teacher sites and the students share its layers;
    # an fp16 copy made per module holding a layer counted the sites' weights twice)
    frozen = [b for b in tree.buffers() if b.dtype == torch.float16]
    assert sum(b.numel() for b in frozen) == ranks_mod.param_count(shapes) and {b.device.type for b in frozen} == {"meta"}
    a = vram.analytic(cfg, ranks, TrainConfig(), 8, "adamw")
    assert a["adapter_params"] == trainable and a["stage2_static_gib"] > a["teacher_gib"]
    # stage 1's whole-UNet error measurement holds the folded layers beside the teacher: their bytes, counted from
    # the layers a slim module built on meta actually replaces (fp16 on CUDA: 2 bytes a parameter)
    unet = build_diffusers_unet(cfg, device="meta")
    slim = swap.slim_module(unet, adapters.AdapterSet.shaped_like(shapes, "sd15", 0.5, ranks))
    teacher_params = {id(p) for p in unet.parameters()}
    folded = sum(p.numel() for p in slim.parameters() if id(p) not in teacher_params)
    assert a["folded_gib"] * 2 ** 30 == folded * 2


def test_vram_estimator_model_offloaded_holds_the_teacher_off_the_device(monkeypatch):
    """``--offload-teacher``'s estimate: the frozen teacher in CPU RAM (never made on the estimated device), the
    adapters on that device, and a forward that copies each layer there for its call (so the estimator counts what
    the trainer's offloaded teacher puts on the device: a layer at a time)."""
    from sdslim_core.modules import offload
    from sdslim_core.train import vram
    from sdslim_core.vram.settings import Settings
    cfg = tiny_config()
    shapes = {k: tuple(v.shape) for k, v in _canon(build_diffusers_unet(cfg, device="meta")).items()}
    ranks = rank_policy.ranks_for_ratio(layout.sites(shapes), 0.5)
    monkeypatch.setenv(vram._ENV, json.dumps({"ranks": ranks, "train": list(ranks), "offload": True}))
    with torch.device("meta"):
        tree = vram.estimator_model(Settings(unet_config=layout.diffusers_config(cfg), resolution=64))
        calib = vram.teacher_model(Settings(unet_config=layout.diffusers_config(cfg), resolution=64))
    frozen = [b for b in tree.buffers() if b.dtype == torch.float16]
    assert sum(b.numel() for b in frozen) == ranks_mod.param_count(shapes) and {b.device.type for b in frozen} == {"cpu"}
    assert {p.device.type for p in tree.parameters()} == {"meta"}
    assert {b.device.type for b in calib.buffers()} == {"cpu"} and offload.target(calib) == torch.device("meta")
    x, t, ctx = (torch.zeros(1, 4, 8, 8, device="meta"), torch.zeros(1, device="meta"),
                 torch.zeros(1, 7, cfg.context_dim, device="meta"))
    with torch.autocast("cpu", enabled=False):
        out = tree(x.half(), t, encoder_hidden_states=ctx.half()).sample
    assert out.device.type == "meta" and {b.device.type for b in frozen} == {"cpu"}    # the copies were dropped


# ------------------------------------------------------------------------------------------ other teachers

def test_teacher_from_an_ldm_module_is_the_same_network(tiny_ldm_unet):
    """ComfyUI/A1111 hand over LDM UNetModel trees: the trainer's diffusers teacher computes the same function."""
    from sdslim_core.modules.unet import load_diffusers_unet
    from sdslim_core.train.teacher import teacher_weights
    weights, cfg = teacher_weights(tiny_ldm_unet)
    assert cfg.num_heads == tiny_ldm_unet.num_heads
    teacher = load_diffusers_unet(weights, cfg, dtype=torch.float64).eval()
    x, t, ctx = _inputs(cfg, torch.float64)
    with torch.no_grad():
        a = tiny_ldm_unet(x, timesteps=t, context=ctx)
        b = teacher(x, t, encoder_hidden_states=ctx).sample
    assert ((a - b).norm() / a.norm()).item() < 1e-9


def test_sdxl_layout_trains_with_pooled_and_time_ids(tmp_path):
    from sdslim_core.train import Calibration, train_adapters
    torch.manual_seed(0)
    cfg = tiny_config("sdxl")
    unet = build_diffusers_unet(cfg).eval()
    calib = Calibration(contexts=torch.randn(2, 6, cfg.context_dim), pooled=torch.randn(2, 64))
    tc = TrainConfig(n_trajectories=4, sample_steps=2, latent_size=8, stage1_steps=1, stage2_steps=1, ff_inputs=16,
                     res_maps=16)
    result = train_adapters(unet, cfg, calib, tc, tmp_path / "a.safetensors")
    assert result.adapters.family == "sdxl"
    bank = cal.InputBank.load(tmp_path / "a.safetensors.work" / "calib" / cal.BANK_FILE)
    assert bank.pooled.shape == (3, 64) and bank.time_ids.shape == (len(bank), 6)
    assert torch.equal(bank.time_ids[0], torch.tensor([64.0, 64.0, 0.0, 0.0, 64.0, 64.0]))
    assert set(result.report.unet_error) == {"init", "stage1", "stage2"}
