"""End-to-end training on a tiny SD-layout teacher (random weights, fixed seed): errors fall stage by stage, the
adapter file carries the metadata the rest of sdslim relies on, a killed run resumes bit-for-bit, and a damaged
checkpoint gives a clear error while the previous one is kept."""
import json
import shutil

import pytest
import torch

from conftest import HANG_GUARD_S, tiny_config
from sdslim_core import layout
from sdslim_core.io.adapters import AdapterSet
from sdslim_core.modules.unet import build_diffusers_unet
from sdslim_core.train import Calibration, CheckpointError, TrainConfig, train_adapters

# many short trajectories: the held-out split is by trajectory, and stage 1 generalises only with diverse data
FAST = dict(ratio=0.5, uniform=True, n_trajectories=40, sample_steps=2, guidance=3.0, latent_size=16, ff_inputs=160, res_maps=128,
            stage1_steps=16, stage2_steps=8, lr1=1e-3, lr2=3e-4, checkpoint_every=3, seed=0)



class Killed(Exception):
    pass


def _teacher():
    torch.manual_seed(0)
    return build_diffusers_unet(tiny_config()).eval()


def _calib():
    ctx = torch.randn(3, 6, tiny_config().context_dim, generator=torch.Generator().manual_seed(1))
    return Calibration.from_contexts(ctx)


def _kill_at(step):
    def progress(done, total, info):
        if done == step:
            raise Killed(f"simulated kill at step {done}")
    return progress


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "adapters.safetensors"
    calls = []
    result = train_adapters(_teacher(), tiny_config(), _calib(), TrainConfig(**FAST), out,
                            progress=lambda d, n, info: calls.append((d, n, info["stage"])))
    return result, out, calls


def test_errors_fall_stage_by_stage(reference):
    result, _, _ = reference
    rep = result.report
    init, s1 = rep.site_error["init"], rep.site_error["stage1"]
    assert set(init) == set(s1) == set(result.adapters.sites) and len(init) == 28
    worse = {s: (init[s], s1[s]) for s in init if not s1[s] < init[s]}
    assert not worse, f"stage 1 did not lower these sites' errors: {worse}"
    u = rep.unet_error
    assert u["stage1"] < u["init"] and u["stage2"] < u["stage1"], u
    summary = rep.init_summary()
    assert summary["act_select"]["wins"] >= 14                      # activation-aware init wins most sites
    assert summary["act_select"]["mean_error"] < summary["weight_svd"]["mean_error"]


def test_progress_reports_every_step_and_every_phase_before_them(reference):
    result, _, calls = reference
    n1 = FAST["stage1_steps"] * 28
    steps = [c for c in calls if c[2] in (1, 2)]
    assert [d for d, _, _ in steps] == list(range(1, n1 + FAST["stage2_steps"] + 1))
    assert {n for _, n, _ in steps} == {n1 + FAST["stage2_steps"]}
    assert [s for _, _, s in steps].count(2) == FAST["stage2_steps"]
    phases = [s for _, _, s in calls[:calls.index(steps[0])]]        # a host can stop the run in each of them
    assert phases.count("calibration") == FAST["n_trajectories"] // 4 and phases.count("init") == 28
    assert "capture" in phases and set(phases) == {"calibration", "capture", "init"}


def test_adapter_file_metadata_and_plot(reference):
    result, out, _ = reference
    aset = AdapterSet.load(out)
    assert aset.family == "sd15" and aset.ranks() == result.adapters.ranks()
    train = aset.metadata["sdslim.train"]
    errors = aset.site_errors()
    assert set(errors) == set(aset.sites) and all(0 < e < 2 for e in errors.values())
    assert train["steps"] == {"stage1_per_site": 16, "stage2": 8}
    assert train["data"]["n_inputs"] == 40 * 2 * 2 and train["data"]["source"] == "contexts"
    assert set(train["unet_error"]) == {"init", "stage1", "stage2"}
    assert aset.metadata["sdslim.base"]["family"] == "sd15"
    # the base fingerprint: the teacher is at distance 0 from it, every folded tensor sketched
    from sdslim_core.ops import fingerprint, fold
    teacher = layout.to_canonical(_teacher().state_dict())[0]
    meter = fingerprint.DistanceMeter(aset.metadata["sdslim.base"])
    for site in aset.sites:
        for k in fold.site_keys(site, aset.kind(site)):
            meter.add(site, k, teacher.get(k))
    assert meter.result().overall == 0.0 and not meter.result().missing and meter.result().compared > 3 * len(aset.sites)
    half = aset.select(0.5)
    kept = sorted(errors, key=errors.get)[:14]
    assert set(half.sites) == set(kept)
    for site, t in aset.sites.items():
        for name, v in t.items():
            assert torch.equal(v, result.adapters.sites[site][name])
    png = out.with_name("adapters.errors.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = result.report.text()
    assert "act_select" in text and "stage1" in text
    json.dumps(result.report.to_dict())


def test_killed_run_resumes_bit_for_bit_and_corrupt_checkpoint_is_reported(reference, tmp_path):
    ref, _, _ = reference
    out = tmp_path / "b" / "adapters.safetensors"
    tc = TrainConfig(**FAST)
    n1 = FAST["stage1_steps"] * 28
    with pytest.raises(Killed):                                     # in stage 1, mid-site, between checkpoints
        train_adapters(_teacher(), tiny_config(), _calib(), tc, out, progress=_kill_at(100))
    with pytest.raises(Killed):                                     # in stage 2, after checkpoints at 3 and 6
        train_adapters(_teacher(), tiny_config(), _calib(), tc, out, progress=_kill_at(n1 + 7), resume=True)
    work = out.with_name(out.name + ".work")
    # a copy of the work dir with its newest stage-2 checkpoint damaged: clear error, previous one kept
    bad_out = tmp_path / "c" / "adapters.safetensors"
    bad_work = bad_out.with_name(bad_out.name + ".work")
    shutil.copytree(work, bad_work)
    ckpts = sorted((bad_work / "checkpoints").glob("s2-*.safetensors"))
    assert [p.name for p in ckpts] == ["s2-000000003.safetensors", "s2-000000006.safetensors"]
    ckpts[-1].write_bytes(ckpts[-1].read_bytes()[:-64])
    with pytest.raises(CheckpointError, match="s2-000000003"):
        train_adapters(_teacher(), tiny_config(), _calib(), tc, bad_out, resume=True)
    assert ckpts[0].exists() and ckpts[-1].exists()
    # the real run continues where it stopped
    result = train_adapters(_teacher(), tiny_config(), _calib(), tc, out, resume=True)
    assert result.adapters.ranks() == ref.adapters.ranks()
    for site, t in ref.adapters.sites.items():
        for name, v in t.items():
            assert torch.equal(result.adapters.sites[site][name], v), (site, name)
    assert result.report.unet_error == ref.report.unet_error
    assert result.report.site_error == ref.report.site_error


def test_resume_refuses_a_work_dir_of_other_settings(reference):
    _, out, _ = reference
    other = TrainConfig(**dict(FAST, lr1=1e-2))
    with pytest.raises(ValueError, match="lr1"):
        train_adapters(_teacher(), tiny_config(), _calib(), other, out, resume=True)


# ------------------------------------------------------------------------------------------- two processes

def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_cpu_processes_shard_stage1_and_share_stage2(reference, tmp_path):
    """The ``accelerate launch`` path with 2 CPU processes (gloo, started by torch.distributed.run): stage 1 shards
    the sites, stage 2 is data-parallel; both processes end with the same adapters."""
    import os
    import subprocess
    import sys
    _, ref_out, _ = reference
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(here), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), os.path.join(here, "train_dist_worker.py"), str(tmp_path),
           json.dumps(dict(FAST, stage2_steps=4))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a, b = (AdapterSet.load(tmp_path / f"rank{r}.safetensors") for r in (0, 1))
    for site, t in a.sites.items():                      # gradients were averaged: both processes agree
        for name, v in t.items():
            assert torch.equal(v, b.sites[site][name]), (site, name)
    info = json.loads((tmp_path / "rank0.json").read_text())
    assert info["world"] == 2
    # stage 1 does not depend on how the sites are sharded: the single-process adapters (up to thread count)
    ref_s1 = AdapterSet.load(ref_out.with_name(ref_out.name + ".work") / "stage1.safetensors")
    two_s1 = AdapterSet.load(tmp_path / "adapters.safetensors.work" / "stage1.safetensors")
    assert set(two_s1.sites) == set(ref_s1.sites) == set(a.sites)
    for site, t in ref_s1.sites.items():
        for name, v in t.items():
            assert torch.allclose(two_s1.sites[site][name], v, atol=2e-4), (site, name)
    u = info["unet_error"]
    assert u["stage2"] < u["stage1"] < u["init"], u
    saved = AdapterSet.load(tmp_path / "adapters.safetensors")
    assert saved.metadata["sdslim.train"]["processes"] == 2
    assert set(saved.site_errors()) == set(a.sites)


def test_stage2_in_groups_resumes_bit_for_bit_in_the_split_it_started_with(tmp_path, monkeypatch):
    """Stage 2 in 3 site groups (the low-VRAM mode): killed inside the second group, resumed, same adapters, even
    when ``auto`` would pick another split now (on CUDA it follows what else the GPU holds): the resumed run
    trains in the 3 groups its group files and checkpoints were made in (``stage2/groups.json``)."""
    from sdslim_core.train import stage2
    small = dict(FAST, n_trajectories=10, latent_size=8, ff_inputs=40, res_maps=40, stage1_steps=0, stage2_steps=9,
                 stage2_groups="auto")
    said = []
    tc = TrainConfig(**small, log=said.append)
    monkeypatch.setattr(stage2, "resolve_groups", lambda session, ranks: 3)
    ref = train_adapters(_teacher(), tiny_config(), _calib(), tc, tmp_path / "a" / "adapters.safetensors")
    assert ref.report.timing["stage2_groups"] == 3
    assert ref.report.unet_error["stage2"] < ref.report.unet_error["stage1"]
    groups = sorted((tmp_path / "a" / "adapters.safetensors.work" / "stage2").glob("group-*.safetensors"))
    assert len(groups) == 3
    out = tmp_path / "b" / "adapters.safetensors"
    n1 = 0
    with pytest.raises(Killed):
        train_adapters(_teacher(), tiny_config(), _calib(), tc, out, progress=_kill_at(n1 + 5))
    monkeypatch.setattr(stage2, "resolve_groups", lambda session, ranks: 2)
    said.clear()
    result = train_adapters(_teacher(), tiny_config(), _calib(), tc, out, resume=True)
    assert "stage 2 resumes in the 3 groups it started in" in said
    assert result.report.timing["stage2_groups"] == 3
    for site, t in ref.adapters.sites.items():
        for name, v in t.items():
            assert torch.equal(result.adapters.sites[site][name], v), (site, name)
    # a damaged record names the work folder to delete
    split = out.parent / "adapters.safetensors.work" / "stage2" / stage2.SPLIT_FILE
    split.write_text('{"groups": [["not-a-site"]]}')
    with pytest.raises(ValueError, match=r"stage-2 split .* is damaged \(its sites are not this run's\): delete the "
                                         r"work folder"):
        train_adapters(_teacher(), tiny_config(), _calib(), tc, out, resume=True, overwrite=True)


def test_a_resume_after_the_allocation_measures_nothing_again(tmp_path, monkeypatch):
    """A run that allocates ranks (anchored curves), killed in stage 1 and again in stage 2 (its init/ folder, with
    the curves, is gone by then): the resumed runs make no UNet forward and no site initialisation in the
    allocation, read its ranks and report from the work dir, and end with an uninterrupted run's adapters."""
    from sdslim_core import layout
    from sdslim_core.modules.unet import canonical_shapes
    from sdslim_core.train import ranks as ranks_mod
    small = dict(FAST, uniform=False, n_trajectories=8, latent_size=8, ff_inputs=24, res_maps=24, stage1_steps=2,
                 stage2_steps=4, checkpoint_every=2, alloc_inputs=2, rank_grid=(0.25, 0.75))
    tc = TrainConfig(**small)
    counts = {"allocating": False, "forwards": 0, "site_inits": 0}

    def count_forward(module, args):
        if counts["allocating"] and type(module).__name__ == "UNet2DConditionModel":
            counts["forwards"] += 1

    def allocating(fn):
        def wrapped(*args, **kwargs):
            counts["allocating"] = True
            try:
                return fn(*args, **kwargs)
            finally:
                counts["allocating"] = False
        return wrapped
    real_site_init = ranks_mod.site_init

    def site_init(*args, **kwargs):
        counts["site_inits"] += 1
        return real_site_init(*args, **kwargs)
    monkeypatch.setattr(ranks_mod, "choose_ranks", allocating(ranks_mod.choose_ranks))
    monkeypatch.setattr(ranks_mod, "site_init", site_init)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(count_forward)
    try:
        ref = train_adapters(_teacher(), tiny_config(), _calib(), tc, tmp_path / "a" / "adapters.safetensors")
        first = dict(counts)
        out = tmp_path / "b" / "adapters.safetensors"
        n1 = small["stage1_steps"] * len(ref.adapters.sites)
        with pytest.raises(Killed):
            train_adapters(_teacher(), tiny_config(), _calib(), tc, out, progress=_kill_at(n1 - 3))
        assert not (out.with_name(out.name + ".work") / "init").exists()      # the curves went with it
        resumed = []
        for kill in (_kill_at(n1 + 3), None):
            counts.update(forwards=0, site_inits=0)
            try:
                result = train_adapters(_teacher(), tiny_config(), _calib(), tc, out, progress=kill, resume=True)
            except Killed:
                pass
            resumed.append((counts["forwards"], counts["site_inits"]))
    finally:
        hook.remove()
    sites = layout.sites(canonical_shapes(tiny_config()))
    assert first["forwards"] == 2 * len(sites) and first["site_inits"] == len(sites)    # 2 anchors, 1 batch each
    assert resumed == [(0, 0), (0, 0)]
    assert result.report.ranks == ref.report.ranks and result.report.budget == ref.report.budget
    uniform = ranks_mod.ratio_ranks(sites, tc)
    assert ref.report.ranks != uniform                                   # really allocated
    for site, t in ref.adapters.sites.items():
        for name, v in t.items():
            assert torch.equal(result.adapters.sites[site][name], v), (site, name)
    assert result.report.unet_error == ref.report.unet_error and result.report.site_error == ref.report.site_error
    bad = tmp_path / "c" / "adapters.safetensors"                       # a damaged record: an error naming it
    shutil.copytree(out.with_name(out.name + ".work"), bad.with_name(bad.name + ".work"))
    (bad.with_name(bad.name + ".work") / "ranks.json").write_text('{"ranks": ')
    with pytest.raises(ValueError, match=r"ranks\.json is damaged"):
        train_adapters(_teacher(), tiny_config(), _calib(), tc, bad, resume=True)


def test_stage2_step_with_every_site_teacher_still_trains_one(tmp_path):
    """Replacement probability 0 at the start of stage 2 (p0=0), in small site groups: a step where no site is
    replaced would have nothing to train; one site is replaced instead, and the run completes."""
    small = dict(FAST, n_trajectories=10, latent_size=8, ff_inputs=40, res_maps=40, stage1_steps=0, stage2_steps=6,
                 stage2_groups=3, p0=0.0)
    result = train_adapters(_teacher(), tiny_config(), _calib(), TrainConfig(**small), tmp_path / "adapters.safetensors")
    assert result.report.steps["stage2"] == 6
    assert all(torch.isfinite(v).all() for t in result.adapters.sites.values() for v in t.values())


# ------------------------------------------------------------------------- stage 2 in groups when memory is short

@pytest.mark.parametrize("family,ram_gib", [("sdxl", 24), ("sdxl", 64), ("sd15", 24), ("sd15", 8)])
def test_cpu_stage2_groups_are_the_fewest_that_fit_the_ram(family, ram_gib, monkeypatch):
    """On a CPU, ``stage2_groups=auto`` follows the machine's RAM: the largest group's adapter state (fp32 params,
    grads, AdamW moments, bf16 copies: 18 B/param) fits beside the fp32 teacher in 92 % of the RAM less a quarter
    of it, and one group fewer would not (real SD1.5/SDXL shapes, uniform 0.5)."""
    from types import SimpleNamespace
    from sdslim_core import layout
    from sdslim_core.layout import rank_policy
    from sdslim_core.modules.unet import canonical_shapes
    from sdslim_core.train import stage2
    from sdslim_core.train.ranks import adapter_param_count, param_count
    shapes = {k: tuple(v) for k, v in canonical_shapes(layout.config_for_arch(family)).items()}
    sites = layout.sites(shapes)
    ranks = rank_policy.ranks_for_ratio(sites, 0.5)
    ram = ram_gib * 2 ** 30
    monkeypatch.setattr(stage2, "physical_memory", lambda: ram)
    session = SimpleNamespace(tc=TrainConfig(), device=torch.device("cpu"), shapes=shapes, site_list=sites,
                              teacher_dtype=torch.float32, optimizer_name="adamw", say=lambda text: None)
    n = stage2.resolve_groups(session, ranks)
    room = 0.92 * ram - 4 * param_count(shapes) - ram / 4

    def largest(k):
        sizes = {s.name: adapter_param_count([s], ranks) for s in sites}
        return max(sum(sizes[s] for s in g) for g in stage2.split_groups([s.name for s in sites], sizes, k)) * 18
    assert largest(n) <= room or n == len(ranks)
    assert n == 1 or largest(n - 1) > room
    expect_groups = {("sdxl", 24): True, ("sdxl", 64): True, ("sd15", 24): False, ("sd15", 8): True}
    assert (n > 1) == expect_groups[(family, ram_gib)], n


def test_the_plans_warm_up_trains_the_largest_group_with_checkpointing(tmp_path, monkeypatch):
    """When stage 2 trains in groups, the warm-up's stage-2 step holds that many adapters (the largest group's),
    with the run's gradient checkpointing (auto: on once in groups), so the plan needs no more memory than the
    run; the run itself checkpoints too."""
    from sdslim_core.modules import swap
    from sdslim_core.train import stage2
    from sdslim_core.train.plan import make_plan
    from sdslim_core.train.ranks import adapter_param_count
    from sdslim_core.train.session import Session
    from sdslim_core.train.teacher import teacher_weights
    built = []
    real = swap.attach_train_adapters

    def spy(unet, aset):
        student, adapters = real(unet, aset)
        built.append((set(aset.sites), student))
        return student, adapters
    monkeypatch.setattr(swap, "attach_train_adapters", spy)
    weights, cfg = teacher_weights(_teacher(), tiny_config())
    tc = TrainConfig(**dict(FAST, n_trajectories=4, latent_size=8, stage2_groups=3))
    session = Session(weights, cfg, tc, _calib(), tmp_path / "a.safetensors", None, False)
    make_plan(session)
    from sdslim_core.layout import rank_policy
    ranks = rank_policy.ranks_for_ratio(session.site_list, 0.5)
    sizes = {s: adapter_param_count([session.site_by_name[s]], ranks) for s in ranks}
    groups = stage2.split_groups(session.site_order, sizes, 3)
    sites, student = built[0]
    assert sites == set(max(groups, key=lambda g: sum(sizes[s] for s in g))) and len(sites) < len(ranks)
    assert student.is_gradient_checkpointing
    assert session.use_grad_ckpt(3) and not session.use_grad_ckpt(1)
    assert not Session(weights, cfg, TrainConfig(**dict(FAST, grad_ckpt=False)), _calib(), tmp_path / "b.safetensors",
                       None, False).use_grad_ckpt(3)
