"""Stand-in for ``modules.shared``."""
import argparse

from modules import devices, memmon, options

options_templates = {}
opts = options.Options(options_templates, set())
cmd_opts = argparse.Namespace(medvram=False, lowvram=False, medvram_sdxl=False, no_half=False, lora_dir=None,
                              skip_install=False)
sd_model = None
device = devices.device
state = argparse.Namespace(interrupted=False, skipped=False, job="")
mem_mon = memmon.MemUsageMonitor("MemMon", device, opts)

OptionInfo = options.OptionInfo
options_section = options.options_section
