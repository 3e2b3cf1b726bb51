"""Training from the webui's SD Slim tab vs the trainer called directly, side by side, in the A1111 stand-in.

Both train the stand-in's tiny SD1.5-structure LDM UNet (the tests' model) with the same settings: the tab
(``scripts/sdslim.py``: webui conditioning, GPU-call wrapper, job state, Interrupt checks, work folder) and a
direct ``train_adapters`` call on the same teacher weights and calibration. An untimed one-step run warms up
the imports; then the two alternate which goes first. Prints seconds per run, the tab's time relative to the
direct call, and whether the adapters are identical.

    python bench/a1111_train.py [--steps 50] [--repeats 2] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50, help="the tab's Steps (both stages)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from a1111_standin import harness
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as tmp:
        harness._purge()
        mp.syspath_prepend(harness.STANDIN)
        harness._float64_ldm(mp)
        from modules import paths
        paths.models_path = os.path.join(tmp, "models")
        import networks
        networks.standin_install()
        from sdslim_core.hosts.a1111 import training
        from sdslim_core.io.adapters import AdapterSet
        from sdslim_core.train import train_adapters
        s = harness.Session(harness.tiny_unet())
        form = training.parse_form("a red cube on a table\na blue ball in the grass", "", 0.5, "", a.steps, 64, 0,
                                   "x")
        weights, cfg = training.teacher(s.unet)
        calib, _ = s.module._webui_calibration(s.sd_model, form, cfg, 64)
        options = form.options(cfg, next(s.unet.parameters()).dtype, "cpu")
        def tab_run(name, steps):
            t0 = time.perf_counter()
            text = s.module.train("task(bench)", "\n".join(form.prompts), form.negative, form.ratio, "", steps,
                                  form.size, form.seed, name)[0]
            assert text.startswith("adapters written"), text
            return time.perf_counter() - t0

        def direct_run(name):
            t0 = time.perf_counter()
            train_adapters(weights, cfg, calib, out_path=os.path.join(tmp, f"{name}.safetensors"), **options)
            return time.perf_counter() - t0

        tab_run("warmup", 1)
        rows = []
        for i in range(a.repeats):
            if i % 2:
                direct_s, tab_s = direct_run(f"direct{i}"), tab_run(f"tab{i}", form.steps)
            else:
                tab_s, direct_s = tab_run(f"tab{i}", form.steps), direct_run(f"direct{i}")
            tab = AdapterSet.load(os.path.join(paths.models_path, "sdslim", f"tab{i}.safetensors")).state_dict()
            direct = AdapterSet.load(os.path.join(tmp, f"direct{i}.safetensors")).state_dict()
            same = tab.keys() == direct.keys() and all(torch.equal(v, direct[k]) for k, v in tab.items())
            rows.append((tab_s, direct_s, same))
        networks.standin_uninstall()
        harness._purge()
    print(f"tiny SD1.5-structure LDM UNet (stand-in), {len(weights)} tensors, 64 px, steps {a.steps}, "
          f"{a.threads} threads, load average {os.getloadavg()[0]:.1f}")
    print("| run | tab s | direct s | tab / direct | identical adapters |")
    print("|---|---|---|---|---|")
    for i, (tab_s, direct_s, same) in enumerate(rows):
        print(f"| {i} | {tab_s:.1f} | {direct_s:.1f} | {tab_s / direct_s:.2f} | {same} |")


if __name__ == "__main__":
    main()
