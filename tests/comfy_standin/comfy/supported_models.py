"""Stand-in for ``comfy.supported_models``: the model configs detection tries, in order (see model_detection)."""
models = []
