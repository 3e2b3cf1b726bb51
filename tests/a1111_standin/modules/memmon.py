"""Stand-in for ``modules.memmon``: the monitor is disabled without CUDA, as upstream does."""
import torch


class MemUsageMonitor:
    def __init__(self, name, device, opts):
        self.name = name
        self.device = device
        self.opts = opts
        self.data = {}
        self.disabled = not torch.cuda.is_available()

    def monitor(self):
        """Upstream starts polling here (and resets CUDA peak statistics); nothing to do on the CPU."""

    def read(self):
        return dict(self.data)

    def stop(self):
        return self.read()
