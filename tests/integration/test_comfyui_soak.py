"""Soak: a real ComfyUI server runs many prompts of the shipped tiny model (opt-in, a few minutes on a CPU).

    COMFYUI_PATH=/path/to/ComfyUI COMFYUI_SOAK=1 /path/to/comfy-venv/bin/python -m pytest \\
        tests/integration/test_comfyui_soak.py -q -s

``COMFYUI_SOAK_PROMPTS`` (default 120) prompts are queued over HTTP, each the tiny demo workflow
(``example_workflows/api/tiny_demo.json``: Load Tiny Demo Model, LoRA, Slim UNet, ControlNet, KSampler, VAE
Decode, Save Image, VRAM Report) with Slim UNet on or off, one of two adapter files, two strengths, the LoRA
before Slim UNet, after it or absent at two strengths, with or without the ControlNet, and a new seed. The last
``CONCURRENT`` of them are submitted at once by two websocket clients with their own client ids. What must hold:
every prompt succeeds (its /history status, its image and its report); the same setting and seed early and late
in the run give the same pixels; the server's RSS after the warm-up grows by at most 5 %; ComfyUI never holds
more than a bounded number of slim models (the VRAM Report lists the loaded ones); each client hears only about
its own prompts.
"""
import asyncio
import copy
import dataclasses
import itertools
import json
import os
import random
import re

import pytest

from conftest import HANG_GUARD_S

COMFY = os.environ.get("COMFYUI_PATH")
pytestmark = pytest.mark.skipif(not COMFY or os.environ.get("COMFYUI_SOAK") != "1",
                                reason="set COMFYUI_PATH and COMFYUI_SOAK=1 to run the ComfyUI soak")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = int(os.environ.get("COMFYUI_SOAK_PROMPTS", "120"))
CONCURRENT = 20
STEPS = 6
TEMPLATE = json.load(open(os.path.join(ROOT, "example_workflows", "api", "tiny_demo.json")))
ADAPTERS = ("tiny_sd15_slim_half.safetensors", "quarter.safetensors")


@dataclasses.dataclass(frozen=True)
class Setting:
    slim: bool = True
    adapters: str = ADAPTERS[0]
    strength: float = 1.0
    lora: str = "before"               # before | after | none (Slim UNet's position relative to the LoRA loader)
    lora_strength: float = 1.0
    controlnet: bool = True


ALL = sorted({Setting(slim, a if slim else ADAPTERS[0], s if slim else 1.0, lo, ls if lo != "none" else 1.0, cn)
              for slim, a, s, lo, ls, cn in itertools.product((True, False), ADAPTERS, (1.0, 0.5),
                                                             ("before", "after", "none"), (1.0, 0.5), (True, False))},
             key=repr)
# every value of every field at least once, LoRA before and after Slim UNet at each adapter file
WARM_UP = [Setting(), Setting(lora="after"), Setting(adapters=ADAPTERS[1]), Setting(adapters=ADAPTERS[1], lora="after"),
           Setting(strength=0.5, lora_strength=0.5), Setting(lora="none", controlnet=False),
           Setting(slim=False), Setting(slim=False, lora="none"), Setting(lora="after", lora_strength=0.5),
           Setting(adapters=ADAPTERS[1], strength=0.5, controlnet=False)]
REPEATED = WARM_UP[:4]                  # run again with the same seed at the end: the same pixels


def prompt_for(s: Setting, seed: int, tag: str) -> dict:
    """The tiny demo workflow for setting ``s`` (node ids as in the template: 1 model, 2 LoRA, 3 Slim UNet, 10
    ControlNet, 12 KSampler, 14 Save Image, 15 VRAM Report)."""
    g = copy.deepcopy(TEMPLATE)
    g["3"]["inputs"].update(enable=s.slim, adapters=s.adapters, strength=s.strength)
    g["2"]["inputs"]["strength_model"] = s.lora_strength
    if s.lora == "before":
        sampled = ["3", 0]
    elif s.lora == "after":
        g["3"]["inputs"]["model"], g["2"]["inputs"]["model"] = ["1", 0], ["3", 0]
        sampled = ["2", 0]
    else:
        g["3"]["inputs"]["model"] = ["1", 0]
        for node in ("4", "5"):
            g[node]["inputs"]["clip"] = ["1", 1]
        del g["2"]
        sampled = ["3", 0]
    if not s.controlnet:
        for node in ("6", "7", "8", "9", "10"):
            del g[node]
        g["12"]["inputs"].update(positive=["4", 0], negative=["5", 0])
    g["12"]["inputs"].update(model=sampled, seed=seed, steps=STEPS)
    g["15"]["inputs"].update(model=sampled, model_b=["1", 0])
    g["14"]["inputs"]["filename_prefix"] = f"soak/{tag}"
    return g


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """ComfyUI with models/sdslim holding a second adapter file for the tiny model (ratio 0.25, data-free)."""
    from comfyui_server import ComfyServer

    from sdslim_core import layout, tiny
    from sdslim_core.io.adapters import AdapterSet
    from sdslim_core.io.tensors import load_file
    from sdslim_core.layout import rank_policy
    folder = tmp_path_factory.mktemp("soak")
    (folder / "adapters").mkdir()
    weights, _, _ = layout.to_canonical(load_file(tiny.DEFAULT_PATH)[0])
    ranks = rank_policy.ranks_for_ratio(layout.sites(weights), 0.25)
    AdapterSet.init_select(weights, ranks, "sd15").save(folder / "adapters" / ADAPTERS[1])
    with ComfyServer(folder / "comfy", {"sdslim": folder / "adapters"}) as s:
        yield s


def _rss(server) -> int:
    import psutil
    return psutil.Process(server.proc.pid).memory_info().rss


def _check(entry: dict, what) -> dict:
    """The checks every prompt passes; its outputs."""
    status = entry["status"]
    assert status["status_str"] == "success" and status["completed"], (what, status)
    assert not [m for m in status["messages"] if m[0] == "execution_error"], (what, status["messages"])
    out = entry["outputs"]
    assert len(out["14"]["images"]) == 1, (what, out)
    report = out["15"]["text"][0]
    assert "loaded models:" in report, (what, report)
    assert ("original vs slim" in report) == what[1].slim, (what, report)
    return out


def _pixels(server, image: dict):
    from PIL import Image
    path = server.folder / "output" / image["subfolder"] / image["filename"]
    return Image.open(path).convert("RGB").tobytes()


def _slim_loaded(report: str) -> int:
    return len(re.findall(r"^  \w+ \(slim\): weights", report, flags=re.M))


async def _client(server, name: str, settings: list, seeds: list) -> tuple[list, set]:
    """One websocket client: submits its prompts at once, then reads its messages until each prompt has
    finished; (its prompt ids, the prompt ids its messages named)."""
    import aiohttp
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{server.base}/ws?clientId={name}") as ws:
            ids = []
            for i, (s, seed) in enumerate(zip(settings, seeds)):
                body = {"prompt": prompt_for(s, seed, f"{name}-{i}"), "client_id": name}
                async with session.post(server.base + "/prompt", json=body) as r:
                    ids.append((await r.json())["prompt_id"])
            heard, done = set(), set()
            while done != set(ids):
                msg = await ws.receive(timeout=HANG_GUARD_S)
                if msg.type != aiohttp.WSMsgType.TEXT:
                    assert msg.type == aiohttp.WSMsgType.BINARY, msg      # previews
                    continue
                data = json.loads(msg.data).get("data", {})
                if "prompt_id" in data:
                    heard.add(data["prompt_id"])
                kind = json.loads(msg.data)["type"]
                if kind in ("execution_success", "execution_error", "execution_interrupted"):
                    assert kind == "execution_success", (name, msg.data[:2000])
                    done.add(data["prompt_id"])
            return ids, heard


def test_many_prompts_succeed_with_bounded_memory_and_the_same_pixels(server):
    rng = random.Random(0)
    plan = [(s, 1000 + i) for i, s in enumerate(WARM_UP)]
    plan += [(rng.choice(ALL), 2000 + i) for i in range(PROMPTS - len(WARM_UP) - len(REPEATED) - CONCURRENT)]
    images, most_slim, rss = {}, 0, []
    for i, (s, seed) in enumerate(plan):
        out = _check(server.wait(server.queue(prompt_for(s, seed, f"p{i}"))), (i, s))
        most_slim = max(most_slim, _slim_loaded(out["15"]["text"][0]))
        if i < len(REPEATED):
            images[s] = _pixels(server, out["14"]["images"][0])
        if i == len(WARM_UP) - 1:
            rss.append(_rss(server))
    for i, s in enumerate(REPEATED):                       # the same setting and seed after everything else
        out = _check(server.wait(server.queue(prompt_for(s, 1000 + i, f"again{i}"))), ("again", s))
        assert _pixels(server, out["14"]["images"][0]) == images[s], s

    half = CONCURRENT // 2
    picks = [rng.choice(ALL) for _ in range(CONCURRENT)]

    async def both():
        return await asyncio.gather(_client(server, "soak-a", picks[:half], range(3000, 3000 + half)),
                                    _client(server, "soak-b", picks[half:], range(4000, 4000 + half)))
    (ids_a, heard_a), (ids_b, heard_b) = asyncio.run(both())
    assert heard_a == set(ids_a) and heard_b == set(ids_b)          # each client hears its own prompts only
    for pid, s in zip(ids_a + ids_b, picks):
        entry = server.get(f"/history/{pid}")[pid]
        assert entry["prompt"][3]["client_id"] == ("soak-a" if pid in ids_a else "soak-b")
        out = _check(entry, ("concurrent", s))
        most_slim = max(most_slim, _slim_loaded(out["15"]["text"][0]))
    rss.append(_rss(server))
    total = len(plan) + len(REPEATED) + CONCURRENT
    print(f"\nComfyUI soak: {total} prompts ({CONCURRENT} from two concurrent clients), all succeeded; server RSS "
          f"after the warm-up {rss[0] / 2 ** 20:.1f} MiB, at the end {rss[1] / 2 ** 20:.1f} MiB "
          f"({rss[1] / rss[0] - 1:+.1%}); at most {most_slim} slim models loaded at a time")
    assert rss[1] <= 1.05 * rss[0], rss
    assert most_slim <= 2, most_slim
    log = server.log_since_start()
    assert "Traceback" not in log and "ERROR" not in log and "Exception" not in log, log[-3000:]
