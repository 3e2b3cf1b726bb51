"""sdslim_core.ops.sampling against diffusers' schedulers (an independent implementation of the same conventions)."""
import pytest
import torch

from sdslim_core.ops import sampling

SD_BETAS = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")


def toy_model(x, t, context, shift=None):
    """A nonlinear eps model that depends on x, t and context (and an optional residual)."""
    eps = torch.tanh(0.7 * x + 0.001 * t.view(-1, 1, 1, 1) + context.mean(dim=(1, 2)).view(-1, 1, 1, 1))
    return eps if shift is None else eps + shift


def diffusers_loop(scheduler, noise, context, uncond, guidance, steps):
    scheduler.set_timesteps(steps)
    x = noise * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        xin = scheduler.scale_model_input(x, t)
        tt = torch.full((x.shape[0],), float(t))
        e_u, e_c = toy_model(xin, tt, uncond), toy_model(xin, tt, context)
        x = scheduler.step(e_u + guidance * (e_c - e_u), t, x).prev_sample
    return x


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64),
            torch.randn(2, 3, 16, generator=g, dtype=torch.float64), torch.randn(2, 3, 16, generator=g,
                                                                                    dtype=torch.float64))


@pytest.mark.parametrize("steps", [1, 7, 20])
def test_ddim_matches_diffusers(inputs, steps):
    from diffusers import DDIMScheduler
    noise, ctx, unc = inputs
    ref = diffusers_loop(DDIMScheduler(**SD_BETAS, steps_offset=1, set_alpha_to_one=False, clip_sample=False,
                                       timestep_spacing="leading"), noise.float(), ctx.float(), unc.float(), 5.0,
                         steps)
    out = sampling.sample(toy_model, noise, ctx.float(), unc.float(), steps=steps, guidance=5.0, method="ddim")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("steps", [2, 12])
def test_euler_matches_diffusers(inputs, steps):
    from diffusers import EulerDiscreteScheduler
    noise, ctx, unc = inputs
    ref = diffusers_loop(EulerDiscreteScheduler(**SD_BETAS, timestep_spacing="linspace"), noise.float(),
                         ctx.float(), unc.float(), 3.0, steps)
    out = sampling.sample(toy_model, noise, ctx.float(), unc.float(), steps=steps, guidance=3.0, method="euler")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_control_residuals_reach_the_model(inputs):
    noise, ctx, unc = inputs
    ctx, unc = ctx.float(), unc.float()
    seen = []

    def control(x, t, context):
        seen.append(x.shape[0])
        return {"shift": 0.3 * x}

    def baked(x, t, context):
        return toy_model(x, t, context, shift=0.3 * x)

    with_hook = sampling.sample(toy_model, noise, ctx, unc, steps=4, guidance=2.0, control=control)
    ref = sampling.sample(baked, noise, ctx, unc, steps=4, guidance=2.0)
    torch.testing.assert_close(with_hook, ref)
    assert seen == [4] * 4  # called once per step on the CFG-doubled batch
    assert not torch.allclose(with_hook, sampling.sample(toy_model, noise, ctx, unc, steps=4, guidance=2.0))


def test_add_noise_and_schedule_values():
    s = sampling.Schedule()
    acp = s.alphas_cumprod()
    from diffusers import DDPMScheduler
    ref = DDPMScheduler(**SD_BETAS).alphas_cumprod.double()
    torch.testing.assert_close(acp, ref, rtol=1e-6, atol=1e-7)
    x0, n = torch.ones(3, 1, 2, 2), torch.zeros(3, 1, 2, 2)
    t = torch.tensor([0, 500, 999])
    torch.testing.assert_close(s.add_noise(x0, n, t)[:, 0, 0, 0], acp[t].sqrt().float())


def test_schedule_validation():
    assert sampling.Schedule.from_dict(sampling.Schedule().to_dict()) == sampling.Schedule()
    with pytest.raises(ValueError, match="prediction_type"):
        sampling.Schedule.from_dict({"prediction_type": "v_prediction"})
    with pytest.raises(ValueError, match="unknown"):
        sampling.Schedule.from_dict({"rescale_betas": True})
    with pytest.raises(ValueError, match="method"):
        sampling.sample(toy_model, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 1), method="plms")
