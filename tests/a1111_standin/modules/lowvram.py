"""Stand-in for ``modules.lowvram``: with --medvram/--lowvram the webui keeps one part of the model on the GPU at a
time (``module_in_gpu``); ``send_everything_to_cpu`` moves it off."""
import torch

module_in_gpu = None
cpu = torch.device("cpu")
standin_calls = []


def send_everything_to_cpu():
    global module_in_gpu
    standin_calls.append("send_everything_to_cpu")
    if module_in_gpu is not None:
        module_in_gpu.to(cpu)
    module_in_gpu = None
