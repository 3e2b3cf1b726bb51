"""Prompt conditioning from a checkpoint's own text encoders, made as the hosts make it (offline, no hub).

``tokenizer`` finds CLIP's vocabulary on this machine; ``prompts`` cuts prompts into weighted 77-token chunks by
ComfyUI's rules; ``encoders`` builds the checkpoint's CLIP text encoders with transformers; ``conditioning`` puts
them together (:class:`~.conditioning.PromptEncoder`) and reads/writes the conditioning file.
"""
