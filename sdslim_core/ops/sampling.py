"""DDIM (deterministic) and Euler samplers over an SD noise schedule, with classifier-free guidance.

Pure torch. The model is any callable ``fn(x, t, context, **residuals) -> eps`` (``t`` a (B,) tensor); a ControlNet
plugs in as ``control(x, t, context) -> dict`` whose entries are passed to ``fn`` as keyword residuals.
Conventions follow diffusers' SD defaults, so results match ``DDIMScheduler`` (leading spacing, ``steps_offset=1``,
``set_alpha_to_one=False``) and ``EulerDiscreteScheduler`` (linspace spacing).
"""
from dataclasses import asdict, dataclass

import torch

METHODS = ("ddim", "euler")


@dataclass(frozen=True)
class Schedule:
    """Training noise schedule (SD1.x/2.x defaults); epsilon prediction only."""
    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    prediction_type: str = "epsilon"

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown schedule fields {sorted(unknown)}")
        s = cls(**d)
        if s.beta_schedule not in ("scaled_linear", "linear"):
            raise ValueError(f"unsupported beta_schedule {s.beta_schedule!r}")
        if s.prediction_type != "epsilon":
            raise ValueError(f"unsupported prediction_type {s.prediction_type!r} (only 'epsilon')")
        return s

    def to_dict(self) -> dict:
        return asdict(self)

    def alphas_cumprod(self) -> torch.Tensor:
        """ᾱ_t for t = 0..T-1, float64."""
        n = self.num_train_timesteps
        if self.beta_schedule == "scaled_linear":
            betas = torch.linspace(self.beta_start ** 0.5, self.beta_end ** 0.5, n, dtype=torch.float64) ** 2
        else:
            betas = torch.linspace(self.beta_start, self.beta_end, n, dtype=torch.float64)
        return torch.cumprod(1 - betas, 0)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Forward process x_t = sqrt(ᾱ_t) x0 + sqrt(1-ᾱ_t) noise (training)."""
        a = self.alphas_cumprod().to(x0.device)[t].to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
        return a.sqrt() * x0 + (1 - a).sqrt() * noise


def diffusers_fn(unet):
    """Adapt a diffusers ``UNet2DConditionModel`` to ``fn(x, t, context, **residuals)``."""
    def fn(x, t, context, **residuals):
        return unet(x, t, encoder_hidden_states=context, **residuals).sample
    return fn


def _guided(fn, control, x, t, context, uncond, guidance):
    """eps with classifier-free guidance (one batched call when ``uncond`` is given)."""
    tt = torch.full((x.shape[0],), float(t), device=x.device)
    if uncond is None or guidance == 1.0:
        residuals = control(x, tt, context) if control else {}
        return fn(x, tt, context, **residuals)
    xx, ttt, cc = torch.cat([x, x]), torch.cat([tt, tt]), torch.cat([uncond, context])
    residuals = control(xx, ttt, cc) if control else {}
    e_u, e_c = fn(xx, ttt, cc, **residuals).chunk(2)
    return e_u + guidance * (e_c - e_u)


@torch.no_grad()
def sample(fn, noise: torch.Tensor, context: torch.Tensor, uncond: torch.Tensor = None, *,
           schedule: Schedule = Schedule(), steps: int = 20, method: str = "ddim", guidance: float = 7.5,
           control=None) -> torch.Tensor:
    """Denoise standard-normal ``noise`` into latents. ``uncond`` (same shape as ``context``) enables CFG."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not 1 <= steps <= schedule.num_train_timesteps:
        raise ValueError(f"steps must be in 1..{schedule.num_train_timesteps}")
    acp = schedule.alphas_cumprod()
    x = noise.float()
    if method == "ddim":
        ratio = schedule.num_train_timesteps // steps
        for t in (torch.arange(steps - 1, -1, -1) * ratio + 1).tolist():
            a_t = acp[t].item()
            a_prev = acp[t - ratio].item() if t - ratio >= 0 else acp[0].item()
            eps = _guided(fn, control, x, t, context, uncond, guidance).float()
            x0 = (x - (1 - a_t) ** 0.5 * eps) / a_t ** 0.5
            x = a_prev ** 0.5 * x0 + (1 - a_prev) ** 0.5 * eps
        return x
    all_sigmas = ((1 - acp) / acp).sqrt()
    ts = torch.linspace(0, schedule.num_train_timesteps - 1, steps, dtype=torch.float64).flip(0)
    grid = torch.arange(schedule.num_train_timesteps, dtype=torch.float64)
    sigmas = torch.cat([_interp(ts, grid, all_sigmas), torch.zeros(1, dtype=torch.float64)]).tolist()
    x = x * sigmas[0]
    for i, t in enumerate(ts.tolist()):
        s = sigmas[i]
        eps = _guided(fn, control, x / (s * s + 1) ** 0.5, t, context, uncond, guidance).float()
        x = x + eps * (sigmas[i + 1] - s)
    return x


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """np.interp for increasing ``xp``."""
    i = torch.searchsorted(xp, x).clamp(1, len(xp) - 1)
    w = (x - xp[i - 1]) / (xp[i] - xp[i - 1])
    return fp[i - 1] + w * (fp[i] - fp[i - 1])
