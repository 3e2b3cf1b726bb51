"""Stand-in for ``comfy.patcher_extension`` (wrapper kinds)."""


class WrappersMP:
    OUTER_SAMPLE = "outer_sample"
    APPLY_MODEL = "apply_model"


class CallbacksMP:
    ON_CLONE = "on_clone"
