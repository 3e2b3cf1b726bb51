"""AUTOMATIC1111 / Forge webui logic, importable without the webui: ``lora`` (the Lora extension's network modules
as core LoRA modules), ``params`` (settings vs. per-generation override, infotext, adapter folder). The in-place
layer swap it drives is host-neutral (:class:`sdslim_core.modules.live_slim.LiveSlim`); ``scripts/sdslim.py`` is
the webui side."""
