"""V1 node classes (``INPUT_TYPES``/``RETURN_TYPES``) from the specs, for ComfyUI without ``comfy_api.latest``."""
from __future__ import annotations


class AnyType(str):
    """A type string that matches every other type (ComfyUI compares input types with ``!=``)."""

    def __ne__(self, other):
        return False


ANY = AnyType("*")
_NUMBER_OPTS = ("default", "min", "max", "step")


def input_entry(i) -> tuple:
    """The ``(TYPE, options)`` tuple of one spec input."""
    opts = {"tooltip": i.tooltip} if i.tooltip else {}
    if i.kind == "COMBO":
        return (list(i.options()), opts)
    if i.kind in ("FLOAT", "INT", "BOOLEAN", "STRING"):
        for name in _NUMBER_OPTS:
            value = getattr(i, name)
            if value is not None:
                opts[name] = value
        if i.multiline:
            opts["multiline"] = True
    return (ANY if i.kind == "ANY" else i.kind, opts)


def node_class(spec) -> type:
    """A V1 node class running ``spec``."""
    def input_types(cls):
        out = {"required": {}, "optional": {}}
        for i in spec.inputs:
            out["optional" if i.optional else "required"][i.name] = input_entry(i)
        return out

    def run(self, **inputs):
        result = spec.run(**inputs)
        if result.text is None:
            return result.values
        return {"ui": {"text": [result.text]}, "result": result.values}

    attrs = {"INPUT_TYPES": classmethod(input_types), "RETURN_TYPES": tuple(o.kind for o in spec.outputs),
             "RETURN_NAMES": tuple(o.name for o in spec.outputs), "FUNCTION": "run", "CATEGORY": spec.category,
             "DESCRIPTION": spec.description, "OUTPUT_NODE": spec.output_node, "run": run}
    if spec.always_run:
        attrs["IS_CHANGED"] = classmethod(lambda cls, **kw: float("nan"))
    return type(spec.node_id, (), attrs)
