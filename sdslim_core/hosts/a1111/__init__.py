"""AUTOMATIC1111 / Forge webui logic (no webui import): ``swap`` (LiveSlim: slim layers swapped into the live
UNet), ``lora`` (the Lora extension's network modules as core LoRA modules), ``params`` (settings, infotext,
adapter folder). ``scripts/sdslim.py`` is the webui side."""
