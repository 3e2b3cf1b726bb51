"""V3 node classes (``comfy_api.latest.io.ComfyNode``) from the specs."""
from __future__ import annotations

from comfy_api.latest import io, ui

_TYPES = {"MODEL": io.Model, "CLIP": io.Clip, "VAE": io.Vae, "CONTROL_NET": io.ControlNet,
          "CONDITIONING": io.Conditioning, "LATENT": io.Latent,
          "ANY": io.AnyType, "FLOAT": io.Float, "INT": io.Int, "BOOLEAN": io.Boolean, "STRING": io.String,
          "COMBO": io.Combo}


def input_of(i):
    """The V3 input object of one spec input."""
    common = {"optional": i.optional, "tooltip": i.tooltip or None}
    if i.kind == "COMBO":
        return io.Combo.Input(i.name, options=list(i.options()), **common)
    if i.kind in ("FLOAT", "INT"):
        return _TYPES[i.kind].Input(i.name, default=i.default, min=i.min, max=i.max, step=i.step, **common)
    if i.kind == "BOOLEAN":
        return io.Boolean.Input(i.name, default=i.default, **common)
    if i.kind == "STRING":
        return io.String.Input(i.name, default=i.default, multiline=i.multiline, **common)
    return _TYPES[i.kind].Input(i.name, **common)


def node_class(spec) -> type:
    """A ``ComfyNode`` subclass running ``spec``."""
    def define_schema(cls):
        return io.Schema(node_id=spec.node_id, display_name=spec.display_name, category=spec.category,
                         description=spec.description, inputs=[input_of(i) for i in spec.inputs],
                         outputs=[_TYPES[o.kind].Output(display_name=o.name, tooltip=o.tooltip or None)
                                  for o in spec.outputs],
                         is_output_node=spec.output_node, not_idempotent=spec.always_run)

    def execute(cls, **inputs):
        result = spec.run(**inputs)
        return io.NodeOutput(*result.values, ui=None if result.text is None else ui.PreviewText(result.text))

    attrs = {"define_schema": classmethod(define_schema), "execute": classmethod(execute)}
    if spec.always_run:
        attrs["fingerprint_inputs"] = classmethod(lambda cls, **kw: float("nan"))
    return type(spec.node_id, (io.ComfyNode,), attrs)
