"""Stand-in for ``modules.prompt_parser``: ``SdConditioning`` (a list of prompts with the image size and whether
they are negative prompts) and ``get_learned_conditioning``, one schedule entry per prompt (prompt editing is
not emulated), cached per prompt text, the model's ``get_learned_conditioning`` called with an SdConditioning."""
from collections import namedtuple

ScheduledPromptConditioning = namedtuple("ScheduledPromptConditioning", ["end_at_step", "cond"])


class SdConditioning(list):
    def __init__(self, prompts, is_negative_prompt=False, width=None, height=None, copy_from=None):
        super().__init__()
        self.extend(prompts)
        copy_from = prompts if copy_from is None else copy_from
        self.is_negative_prompt = is_negative_prompt or getattr(copy_from, "is_negative_prompt", False)
        self.width = width or getattr(copy_from, "width", None)
        self.height = height or getattr(copy_from, "height", None)


def get_learned_conditioning(model, prompts, steps, hires_steps=None, use_old_scheduling=False):
    """[[ScheduledPromptConditioning(steps, cond)] per prompt]; ``cond`` is a tensor or a dict of tensors."""
    res, cache = [], {}
    for prompt in prompts:
        if prompt not in cache:
            conds = model.get_learned_conditioning(SdConditioning([prompt], copy_from=prompts))
            cond = {k: v[0] for k, v in conds.items()} if isinstance(conds, dict) else conds[0]
            cache[prompt] = [ScheduledPromptConditioning(steps, cond)]
        res.append(cache[prompt])
    return res
