"""Optional dependencies: imported where a feature needs them, with a message that says what to install.

``require(module, purpose)`` imports ``module`` (its top-level package first) or raises
:class:`MissingDependency`, e.g. "LoRA settings (lora_rank > 0) need peft, which is not installed; install it
with `pip install sdslim[lora]` (or `pip install peft`)". ``missing(module, purpose)`` gives that message
without importing anything (None when the package is there), for code that skips a feature instead.
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# import name -> (distribution, the pip argument that installs it: sdslim's extra where it has one)
PACKAGES = {
    "peft": ("peft", "sdslim[lora]"),
    "lycoris": ("lycoris-lora", "lycoris-lora"),     # a dependency; imported lazily (it is slow to import)
    "accelerate": ("accelerate", "sdslim[train]"),
    "transformers": ("transformers", "sdslim[text]"),
    "xformers": ("xformers", "sdslim[xformers]"),
    "bitsandbytes": ("bitsandbytes", "bitsandbytes"),
    "matplotlib": ("matplotlib", "matplotlib"),
    "gguf": ("gguf", "sdslim[gguf]"),               # GGUF files; ComfyUI-GGUF brings it to ComfyUI itself
}


class MissingDependency(ImportError):
    """An optional package a feature needs cannot be imported; the message names what to install."""


def _how(top: str) -> str:
    dist, pip_arg = PACKAGES[top]
    also = "" if pip_arg == dist else f" (or `pip install {dist}`)"
    return f"install it with `pip install {pip_arg}`{also}"


def message(module: str, purpose: str, error: ImportError | None = None) -> str:
    """Why ``purpose`` cannot run without ``module``'s package, and how to install it."""
    top = module.partition(".")[0]
    dist = PACKAGES[top][0]
    if error is None or getattr(error, "name", None) == top:
        state = "which is not installed"
    else:       # the package is there; something it (or the feature) imports is not
        state = f"which is installed but cannot be imported ({type(error).__name__}: {error})"
    return f"{purpose} needs {dist}, {state}; {_how(top)}"


def require(module: str, purpose: str) -> ModuleType:
    """``module`` imported (dotted names allowed), or :class:`MissingDependency` naming the ``pip install``."""
    top = module.partition(".")[0]
    try:
        importlib.import_module(top)
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependency(message(module, purpose, err)) from err


def missing(module: str, purpose: str) -> str | None:
    """:func:`message` if ``module``'s package cannot be found, else None (nothing is imported)."""
    top = module.partition(".")[0]
    return message(module, purpose) if importlib.util.find_spec(top) is None else None
