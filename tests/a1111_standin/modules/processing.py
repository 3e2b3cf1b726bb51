"""Stand-in for ``modules.processing``: processing objects and a ``process_images`` that replays the v1.10.1
order of script hooks around a (one-step) UNet call per sampler pass."""
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from modules import devices, infotext_utils, scripts, sd_models, shared

_LORA_TAG = re.compile(r"<lora:([^:>]+):([^>]+)>")


@dataclass(repr=False)
class StableDiffusionProcessing:
    prompt: str = ""
    negative_prompt: str = ""
    seed: int = 0
    n_iter: int = 1
    batch_size: int = 1
    steps: int = 1
    width: int = 64
    height: int = 64
    tiling: bool = False
    override_settings: dict = None
    extra_generation_params: dict = None
    scripts_value: Any = None
    script_args_value: list = None
    disable_extra_networks: bool = False
    refiner_checkpoint: str = None
    is_api: bool = False
    iteration: int = field(default=0, init=False)
    is_hr_pass: bool = field(default=False, init=False)
    comments: dict = field(default=None, init=False)
    all_prompts: list = field(default=None, init=False)
    all_seeds: list = field(default=None, init=False)
    all_subseeds: list = field(default=None, init=False)
    prompts: list = field(default=None, init=False)
    seeds: list = field(default=None, init=False)
    standin_context: Any = None
    standin_outputs: list = field(default_factory=list, init=False)
    standin_script_errors: list = field(default_factory=list, init=False)

    def __post_init__(self):
        self.extra_generation_params = dict(self.extra_generation_params or {})
        self.override_settings = dict(self.override_settings or {})
        self.comments = {}

    @property
    def sd_model(self):
        return shared.sd_model

    @sd_model.setter
    def sd_model(self, value):
        pass

    @property
    def scripts(self):
        return self.scripts_value

    @scripts.setter
    def scripts(self, value):
        self.scripts_value = value

    @property
    def script_args(self):
        return self.script_args_value

    @script_args.setter
    def script_args(self, value):
        self.script_args_value = value

    def comment(self, text):
        self.comments[text] = 1

    def standin_denoise(self, x, conditioning):
        """One UNet call standing in for a sampler pass; the output is recorded for the tests."""
        unet = self.sd_model.model.diffusion_model
        t = torch.full((x.shape[0],), 500, dtype=torch.long, device=x.device)
        with torch.no_grad():
            out = unet(x, t, context=conditioning)
        self.standin_outputs.append(out)
        return out


@dataclass(repr=False)
class StableDiffusionProcessingTxt2Img(StableDiffusionProcessing):
    enable_hr: bool = False
    hr_checkpoint_name: str = None
    hr_checkpoint_info: Any = None

    def sample(self, conditioning, unconditional_conditioning, seeds, subseeds, subseed_strength, prompts):
        g = torch.Generator().manual_seed(int(seeds[0]))          # the webui's CPU noise, moved to its device
        dtype = next(self.sd_model.model.diffusion_model.parameters()).dtype
        x = torch.randn((len(seeds), 4, self.height // 8, self.width // 8), generator=g).to(devices.device, dtype)
        if isinstance(conditioning, torch.Tensor):
            conditioning = conditioning.to(devices.device)
        if hasattr(self.scripts, "process_before_every_sampling"):   # absent before webui 1.10
            self.scripts.process_before_every_sampling(self, x=x, noise=x, c=conditioning,
                                                       uc=unconditional_conditioning)
        samples = self.standin_denoise(x, conditioning)
        if not self.enable_hr:
            return samples
        self.is_hr_pass = True
        if self.hr_checkpoint_info is not None:
            sd_models.reload_model_weights(info=self.hr_checkpoint_info)
        standin_activate_extra_networks(self, prompts, seeds)
        self.scripts.before_hr(self)
        if hasattr(self.scripts, "process_before_every_sampling"):
            self.scripts.process_before_every_sampling(self, x=samples, noise=x, c=conditioning,
                                                       uc=unconditional_conditioning)
        return self.standin_denoise(samples, conditioning)


class Processed:
    def __init__(self, p, images_list, seed=-1, info='', subseed=None, all_prompts=None, all_negative_prompts=None,
                 all_seeds=None, all_subseeds=None, index_of_first_image=0, infotexts=None, comments=''):
        self.images = images_list
        self.seed = seed
        self.info = info
        self.all_prompts = all_prompts or p.all_prompts
        self.all_seeds = all_seeds or p.all_seeds
        self.infotexts = infotexts or [info]
        self.comments = comments
        self.extra_generation_params = dict(p.extra_generation_params)


def standin_activate_extra_networks(p, prompts, seeds):
    """Extra-networks activation: the Lora extension (if loaded) sets this batch's networks from <lora:…> tags;
    then ``after_extra_networks_activate`` runs, as upstream."""
    import sys
    networks = sys.modules.get("networks")
    tags = [] if p.disable_extra_networks else _LORA_TAG.findall(prompts[0])
    if networks is not None and not p.disable_extra_networks:
        names = [n for n, _ in tags]
        mults = [float(m) for _, m in tags]
        networks.load_networks(names, mults, mults, [None] * len(names))
    if not p.disable_extra_networks:
        p.scripts.after_extra_networks_activate(p, batch_number=p.iteration, prompts=prompts, seeds=seeds,
                                                subseeds=seeds, extra_network_data={"lora": tags})


def create_infotext(p, all_prompts, all_seeds, all_subseeds, comments=None, iteration=0, position_in_batch=0,
                    use_main_prompt=False, index=None, all_negative_prompts=None):
    """``prompt\\nNegative prompt: …\\nSteps: …, Seed: …, <extra_generation_params>`` with quoted values."""
    if index is None:
        index = position_in_batch + iteration * p.batch_size
    params = {"Steps": p.steps, "Seed": all_seeds[index], "Size": f"{p.width}x{p.height}"}
    for key, value in p.extra_generation_params.items():
        if isinstance(value, list):
            value = value[index]
        elif callable(value):
            value = value(**locals())
        params[key] = value
    line = ", ".join(f"{k}: {infotext_utils.quote(v)}" for k, v in params.items() if v is not None)
    return f"{all_prompts[index]}\nNegative prompt: {p.negative_prompt}\n{line}"


def process_images(p):
    """Replay of the v1.10.1 order: before_process, process, then per batch before_process_batch, extra-network
    activation (+ after_extra_networks_activate), process_batch, sample (process_before_every_sampling before
    each pass), post_sample, postprocess_batch, infotexts; finally postprocess. Like upstream, an exception in
    sampling propagates and skips postprocess."""
    p.scripts.before_process(p)
    p.scripts.process(p)
    total = p.n_iter * p.batch_size
    p.all_prompts = [p.prompt] * total
    p.all_seeds = [p.seed + i for i in range(total)]
    p.all_subseeds = list(p.all_seeds)
    infotexts, images = [], []
    for n in range(p.n_iter):
        p.iteration = n
        p.is_hr_pass = False
        p.prompts = p.all_prompts[n * p.batch_size:(n + 1) * p.batch_size]
        p.seeds = p.all_seeds[n * p.batch_size:(n + 1) * p.batch_size]
        p.scripts.before_process_batch(p, batch_number=n, prompts=p.prompts, seeds=p.seeds, subseeds=p.seeds)
        standin_activate_extra_networks(p, p.prompts, p.seeds)
        p.scripts.process_batch(p, batch_number=n, prompts=p.prompts, seeds=p.seeds, subseeds=p.seeds)
        samples = p.sample(conditioning=p.standin_context, unconditional_conditioning=None, seeds=p.seeds,
                           subseeds=p.seeds, subseed_strength=0.0, prompts=p.prompts)
        p.scripts.post_sample(p, scripts.PostSampleArgs(samples))
        batch = list(samples)
        p.scripts.postprocess_batch(p, batch, batch_number=n)
        for i in range(len(batch)):
            infotexts.append(create_infotext(p, p.all_prompts, p.all_seeds, p.all_subseeds, iteration=n,
                                             position_in_batch=i))
        images.extend(batch)
    res = Processed(p, images, p.all_seeds[0], infotexts[0], infotexts=infotexts, comments="".join(p.comments))
    p.scripts.postprocess(p, res)
    return res
