"""ComfyUI nodes of sdslim: thin shells over ``sdslim_core`` (see ``entry`` for registration)."""
