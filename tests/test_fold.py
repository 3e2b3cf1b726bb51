"""Fold exactness (float64) against the train-time form, on real-width layers and on tiny full UNets."""
import pytest
import torch
import torch.nn.functional as F

from conftest import randomize_, tiny_config
from sdslim_core import layout
from sdslim_core.io import adapters
from sdslim_core.layout import rank_policy
from sdslim_core.modules import swap
from sdslim_core.ops import fold

TOL = 1e-10


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def random_adapters(weights, ratio, family="sd15", seed=1, ff_only=False):
    """Data-free init, then random perturbation so nothing is a plain selection."""
    site_list = [s for s in layout.sites(weights) if not ff_only or s.kind == "ff"]
    ranks = rank_policy.ranks_for_ratio(site_list, ratio)
    aset = adapters.AdapterSet.init_select(weights, ranks, family)
    g = torch.Generator().manual_seed(seed)
    for t in aset.sites.values():
        for k, v in t.items():
            t[k] = (v + 0.3 * torch.randn(v.shape, generator=g)).double()
    return aset


def test_ff_fold_real_width_matches_train_time_formula():
    g = torch.Generator().manual_seed(0)
    d, m, r = 320, 1280, 640
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    wp, bp, wo, bo = rnd(2 * m, d) / d ** .5, rnd(2 * m), rnd(d, m) / m ** .5, rnd(d)
    av, ag, u = rnd(r, m) / m ** .5, rnd(r, m) / m ** .5, rnd(m, r) / r ** .5
    x = rnd(2, 77, d)
    h = x @ wp.T + bp
    v, gate = h[..., :m], h[..., m:]
    reference = (((v @ av.T) * F.gelu(gate @ ag.T)) @ u.T) @ wo.T + bo
    wp2, bp2, wo2, bo2 = fold.fold_ff(wp, bp, wo, bo, av, ag, u)
    assert wp2.shape == (2 * r, d) and wo2.shape == (d, r)
    v2, g2 = (x @ wp2.T + bp2).chunk(2, dim=-1)
    assert rel_err((v2 * F.gelu(g2)) @ wo2.T + bo2, reference) < TOL


def test_res_fold_real_width_matches_train_time_formula():
    g = torch.Generator().manual_seed(0)
    cin, c, cout, e, r = 320, 320, 320, 1280, 160
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    w1, b1, we, be = rnd(c, cin, 3, 3) / 40, rnd(c), rnd(c, e) / 30, rnd(c)
    w2, b2 = rnd(cout, c, 3, 3) / 40, rnd(cout)
    dn, u = rnd(r, c) / 18, rnd(c, r) / 13
    gamma, beta = rnd(r), rnd(r)
    x, t = rnd(2, cin, 8, 8), rnd(2, e)
    h = F.conv2d(x, w1, b1, padding=1) + (t @ we.T + be)[:, :, None, None]
    h = torch.einsum("rc,bchw->brhw", dn, h)
    h = torch.einsum("cr,brhw->bchw", u, F.silu(F.group_norm(h, 32, gamma, beta)))
    reference = F.conv2d(h, w2, b2, padding=1)
    w1f, b1f, wef, bef, w2f, b2f = fold.fold_res(w1, b1, we, be, w2, b2, dn, u)
    h2 = F.conv2d(x, w1f, b1f, padding=1) + (t @ wef.T + bef)[:, :, None, None]
    out = F.conv2d(F.silu(F.group_norm(h2, 32, gamma, beta)), w2f, b2f, padding=1)
    assert rel_err(out, reference) < TOL


def test_fold_keeps_input_dtype_and_computes_in_float32():
    w = torch.randn(8, 4).half()
    wp2, _, wo2, _ = fold.fold_ff(torch.randn(8, 4).half(), None, torch.randn(4, 4).half(), None,
                                  torch.randn(2, 4), torch.randn(2, 4), torch.randn(4, 2))
    assert wp2.dtype == w.dtype and wo2.dtype == w.dtype


def _diffusers_forward(unet, x, t, ctx, **kw):
    return unet(x, t, encoder_hidden_states=ctx, **kw).sample


def _inputs(cfg, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, cfg.in_channels, 16, 16, generator=g, dtype=torch.float64),
            torch.tensor([10, 700]), torch.randn(2, 5, cfg.context_dim, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_tiny_diffusers_unet_slim_equals_train_time(tiny_diffusers_unet, ratio):
    unet = tiny_diffusers_unet
    weights = layout.to_canonical(unet.state_dict())[0]
    aset = random_adapters(weights, ratio)
    train, _ = swap.attach_train_adapters(unet, aset)
    slim = swap.slim_module(unet, aset, weights)
    x, t, ctx = _inputs(tiny_config())
    with torch.no_grad():
        ref, out = _diffusers_forward(train, x, t, ctx), _diffusers_forward(slim, x, t, ctx)
    assert rel_err(out, ref) < TOL
    assert sum(p.numel() for p in slim.parameters()) < sum(p.numel() for p in unet.parameters())


def test_tiny_ldm_unet_slim_equals_train_time(tiny_ldm_unet):
    unet = tiny_ldm_unet
    weights = dict(unet.state_dict())
    aset = random_adapters(weights, 0.5)
    train, _ = swap.attach_train_adapters(unet, aset)
    slim = swap.slim_module(unet, aset, weights)
    x, t, ctx = _inputs(tiny_config())
    with torch.no_grad():
        assert rel_err(slim(x, t, ctx), train(x, t, ctx)) < TOL


def test_identity_adapters_give_the_original_model(tiny_diffusers_unet):
    unet = tiny_diffusers_unet
    weights = layout.to_canonical(unet.state_dict())[0]
    aset = adapters.AdapterSet.init_select(weights, rank_policy.ranks_for_ratio(layout.sites(weights), 1.0), "sd15")
    slim = swap.slim_module(unet, aset, weights)
    x, t, ctx = _inputs(tiny_config())
    with torch.no_grad():
        assert rel_err(_diffusers_forward(slim, x, t, ctx), _diffusers_forward(unet, x, t, ctx)) < TOL


def test_input_untouched_attention_shared_and_block_shapes_kept(tiny_ldm_unet):
    unet = tiny_ldm_unet
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    weights = dict(unet.state_dict())
    aset = random_adapters(weights, 0.5)
    slim = swap.slim_module(unet, aset, weights)
    after = unet.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)          # input not mutated
    slim_sd = slim.state_dict()
    attn = [k for k in before if ".attn1." in k or ".attn2." in k]
    assert attn and all(slim_sd[k].data_ptr() == after[k].data_ptr() for k in attn)  # shared, bit-identical
    touched = set(fold.fold_state_dict(weights, aset))
    untouched = [k for k in before if k not in touched]
    assert all(slim_sd[k].data_ptr() == after[k].data_ptr() for k in untouched)
    shapes = {}

    def hook(name):
        return lambda m, i, o: shapes.setdefault(name, []).append(tuple(o.shape))
    for tree in (unet, slim):
        handles = [b.register_forward_hook(hook(f"in{i}")) for i, b in enumerate(tree.input_blocks)]
        handles += [b.register_forward_hook(hook(f"out{i}")) for i, b in enumerate(tree.output_blocks)]
        with torch.no_grad():
            tree(*_inputs(tiny_config()))
        for h in handles:
            h.remove()
    assert all(len(v) == 2 and v[0] == v[1] for v in shapes.values())


def _ldm_forward_with_residuals(unet, x, t, ctx, residuals, middle):
    """The ControlNet way: add one residual per input block output and one to the middle block."""
    from ldm.modules.diffusionmodules.util import timestep_embedding
    emb = unet.time_embed(timestep_embedding(t, unet.model_channels, repeat_only=False).to(x.dtype))
    hs, h = [], x
    for block, res in zip(unet.input_blocks, residuals):
        h = block(h, emb, ctx)
        hs.append(h + res)
    h = unet.middle_block(h, emb, ctx) + middle
    for block in unet.output_blocks:
        h = block(torch.cat([h, hs.pop()], dim=1), emb, ctx)
    return unet.out(h)


def test_controlnet_style_residuals_still_add_up(tiny_ldm_unet):
    unet = tiny_ldm_unet
    weights = dict(unet.state_dict())
    aset = random_adapters(weights, 0.5)
    train, _ = swap.attach_train_adapters(unet, aset)
    slim = swap.slim_module(unet, aset, weights)
    x, t, ctx = _inputs(tiny_config())
    shapes = []
    handles = [b.register_forward_hook(lambda m, i, o: shapes.append(o.shape)) for b in unet.input_blocks]
    with torch.no_grad():
        unet(x, t, ctx)
    for h in handles:
        h.remove()
    g = torch.Generator().manual_seed(9)
    residuals = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    middle = torch.randn(shapes[-1], generator=g, dtype=torch.float64)
    with torch.no_grad():
        ref = _ldm_forward_with_residuals(train, x, t, ctx, residuals, middle)
        out = _ldm_forward_with_residuals(slim, x, t, ctx, residuals, middle)
        plain = slim(x, t, ctx)
    assert rel_err(out, ref) < TOL
    assert rel_err(out, plain) > 1e-3          # the residuals really changed the result


def test_diffusers_controlnet_residual_arguments(tiny_diffusers_unet):
    unet = tiny_diffusers_unet
    weights = layout.to_canonical(unet.state_dict())[0]
    aset = random_adapters(weights, 0.5)
    train, _ = swap.attach_train_adapters(unet, aset)
    slim = swap.slim_module(unet, aset, weights)
    x, t, ctx = _inputs(tiny_config())
    g = torch.Generator().manual_seed(4)
    cfg = tiny_config()
    widths = [cfg.model_channels * m for m in cfg.channel_mult]
    sizes = [(widths[0], 16)] + [(widths[0], 16)] * 2 + [(widths[0], 8)] + [(widths[1], 8)] * 2 + \
        [(widths[1], 4)] + [(widths[2], 4)] * 2
    down = tuple(torch.randn(2, c, s, s, generator=g, dtype=torch.float64) for c, s in sizes)
    mid = torch.randn(2, widths[2], 4, 4, generator=g, dtype=torch.float64)
    kw = dict(down_block_additional_residuals=down, mid_block_additional_residual=mid)
    with torch.no_grad():
        assert rel_err(_diffusers_forward(slim, x, t, ctx, **kw), _diffusers_forward(train, x, t, ctx, **kw)) < TOL


def test_sdxl_structure_folds_exactly():
    from sdslim_core.modules.unet import build_diffusers_unet
    cfg = tiny_config("sdxl")
    unet = randomize_(build_diffusers_unet(cfg, dtype=torch.float64)).eval()
    weights = layout.to_canonical(unet.state_dict())[0]
    assert layout.config_from_state_dict(weights, {"num_head_channels": 16}) == cfg
    aset = random_adapters(weights, 0.5, family="sdxl")
    train, _ = swap.attach_train_adapters(unet, aset)
    slim = swap.slim_module(unet, aset, weights)
    x, t, ctx = _inputs(cfg)
    cond = {"text_embeds": torch.randn(2, 64, dtype=torch.float64), "time_ids": torch.randn(2, 6, dtype=torch.float64)}
    with torch.no_grad():
        ref = train(x, t, encoder_hidden_states=ctx, added_cond_kwargs=cond).sample
        out = slim(x, t, encoder_hidden_states=ctx, added_cond_kwargs=cond).sample
    assert rel_err(out, ref) < TOL
