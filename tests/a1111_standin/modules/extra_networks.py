"""Stand-in for ``modules.extra_networks``: ``<name:args>`` tags parsed out of prompts; ``activate`` sets the
Lora extension's networks from them (none for a network not named), then runs ``after_extra_networks_activate``."""
import re
import sys
from collections import defaultdict

re_extra_net = re.compile(r"<(\w+):([^>]+)>")


def parse_prompt(prompt):
    found = defaultdict(list)

    def take(m):
        found[m.group(1)].append(m.group(2).split(":"))
        return ""
    return re_extra_net.sub(take, prompt), found


def parse_prompts(prompts):
    out, data = [], None
    for prompt in prompts:
        text, found = parse_prompt(prompt)
        data = found if data is None else data
        out.append(text)
    return out, data


def activate(p, extra_network_data):
    networks = sys.modules.get("networks")
    if networks is not None:
        items = list((extra_network_data or {}).get("lora", []))
        mults = [float(a[1]) if len(a) > 1 else 1.0 for a in items]
        networks.load_networks([a[0] for a in items], mults, mults, [None] * len(items))
    if getattr(p, "scripts", None) is not None:
        p.scripts.after_extra_networks_activate(p, batch_number=p.iteration, prompts=p.prompts, seeds=p.seeds,
                                                subseeds=p.seeds, extra_network_data=extra_network_data)
