"""`sdslim ui`: serve the web app on this machine (gradio is imported only when the command runs)."""
from __future__ import annotations

import ipaddress
import os
import sys

from . import error_text


def run(args) -> int:
    from ..ui.paths import Roots
    roots = Roots(args.root or [os.getcwd()])
    try:
        from ..ui.app import import_gradio, launch
        import_gradio()
    except ModuleNotFoundError as err:
        if err.name != "gradio":
            raise
        print(error_text("ui", err), file=sys.stderr)
        return 2
    if not _is_loopback(args.host):
        print(f"warning: listening on {args.host}: anyone who can reach this machine can use the UI and read and "
              f"write files in {', '.join(roots.folders)}", file=sys.stderr)
    print(f"sdslim ui: folders {', '.join(roots.folders)}; open http://{args.host}:{args.port}", file=sys.stderr,
          flush=True)
    launch(roots, args.host, args.port)
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def register(sub):
    p = sub.add_parser("ui", help="local web app: plan VRAM, see the breakdown, slim and compare (needs gradio)",
                       description="A local web app (gradio) with the VRAM planner, the parameter breakdown, slim "
                                   "and compare. Files are read and written only inside the --root folders.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7861, help="port (default 7861)")
    p.add_argument("--root", action="extend", nargs="+", default=[], metavar="DIR",
                   help="folder(s) the UI may read and write (repeatable; default: the current folder)")
    p.set_defaults(func=run)
