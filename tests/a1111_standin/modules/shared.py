"""Stand-in for ``modules.shared``."""
import argparse

from modules import devices, memmon, options, shared_state

options_templates = {
    "sdxl_crop_top": options.OptionInfo(0, "crop top coordinate"),
    "sdxl_crop_left": options.OptionInfo(0, "crop left coordinate"),
}
opts = options.Options(options_templates, set())
cmd_opts = argparse.Namespace(medvram=False, lowvram=False, medvram_sdxl=False, no_half=False, lora_dir=None,
                              skip_install=False)
sd_model = None
device = devices.device
state = shared_state.State()
mem_mon = memmon.MemUsageMonitor("MemMon", device, opts)

OptionInfo = options.OptionInfo
options_section = options.options_section
