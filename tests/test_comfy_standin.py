"""The CI stand-in of ComfyUI has the names and signatures recorded from the real one."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(ROOT, "tests", "comfy_standin")


def test_standin_matches_recorded_comfyui_signatures():
    saved_path = list(sys.path)
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in ("comfy", "folder_paths", "signatures")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, STANDIN)
    try:
        import signatures
        recorded = json.load(open(signatures.JSON_PATH))
        assert recorded["comfyui"] and set(recorded["names"]) == set(signatures.NAMES)
        mismatched = {n: (d, recorded["names"][n]) for n, d in signatures.record().items() if d != recorded["names"][n]}
        assert not mismatched
        assert signatures.record_fields() == recorded["modelpatcher_fields"] == sorted(signatures.FIELDS)
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] in ("comfy", "folder_paths", "signatures")]:
            del sys.modules[k]
        sys.modules.update(saved)
        sys.path[:] = saved_path
