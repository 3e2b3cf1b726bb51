"""`sdslim` command line: one module per command in this package (argument parsing and output; the work is
done by the core modules they call).

Every command module exposes ``register(subparsers)``, which adds its sub-parser and sets ``func``
(called with the parsed namespace, returning an exit code). ``--json`` prints one JSON object on
stdout; human output goes to stderr.
"""
import argparse
import importlib
import sys

from ..io.files import DiskFullError, OutputExists
from ..optional import MissingDependency

COMMAND_MODULES = tuple(f"{__name__}.{name}" for name in
                        ("breakdown", "encode", "train", "slim", "lora", "adapters", "evaluate", "vram", "demo",
                          "ui"))

# What a command's bad input (a full disk, an output that exists) raises; the message is shown as it is (CLI and
# ``sdslim ui`` alike).
USER_ERRORS = (ValueError, FileNotFoundError, MissingDependency, DiskFullError, OutputExists)


class CommandImportError(ImportError):
    """A command module failed to import (a bug or a broken install, never skipped silently)."""


def error_text(command: str, err: BaseException) -> str:
    """The one-line error ``sdslim COMMAND`` prints for a bad input."""
    return f"sdslim {command}: error: {err}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdslim", description="Slim SD UNets that keep LoRA/ControlNet working, "
                                                               "and answers to 'where does my VRAM go?'.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as err:
            raise CommandImportError(f"sdslim: command module {name} failed to import: "
                                     f"{type(err).__name__}: {err}") from err
        module.register(sub)
    return parser


def main(argv=None) -> int:
    try:
        parser = build_parser()
    except CommandImportError as err:
        print(err, file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        print(error_text(args.command, err), file=sys.stderr)
        return 2


