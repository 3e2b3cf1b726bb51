"""The one error class sdslim's nodes raise, and the rewording of what a user can trigger into it.

ComfyUI's error dialog names an exception ``type.__module__ + '.' + qualname``; for a class defined in a custom
node pack the module is the pack's file path (``…/custom_nodes/sdslim.nodes.folding``), so :class:`SlimError`
says it comes from module ``sdslim``: the dialog reads ``sdslim.SlimError``.
"""
from __future__ import annotations

from sdslim_core.io.files import OutputExists
from sdslim_core.optional import MissingDependency

OVERWRITE_SWITCH = "overwrite"          # the Save and Train nodes' input that allows replacing a file
USER_ERRORS = (ValueError, OSError, MissingDependency)   # bad input, a missing file or package, a full disk


class SlimError(ValueError):
    """The MODEL, a file or an input cannot be used; the message says which and why."""


SlimError.__module__ = "sdslim"


def reworded(err: BaseException) -> SlimError:
    """``err`` (one of :data:`USER_ERRORS`, not a SlimError) as a :class:`SlimError` with one message: the core's own text, the
    overwrite switch named as the nodes name it, ``sdslim:`` in front once."""
    text = err.message(OVERWRITE_SWITCH) if isinstance(err, OutputExists) else str(err).strip() or type(err).__name__
    return SlimError(text if text.startswith("sdslim") else f"sdslim: {text}")
