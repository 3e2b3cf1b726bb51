"""A real ComfyUI server for the HTTP tests (test_comfyui_real.py, test_comfyui_soak.py).

``ComfyServer(folder, yaml_entries)`` starts ``main.py`` of COMFYUI_PATH on the CPU on a free port, with the pack
symlinked into ``folder/custom_nodes`` and ``yaml_entries`` (folder type → path) added by an extra model paths
file. Everything ComfyUI writes (input, output, temp and user folders, its database) goes under ``folder``, never
into the ComfyUI checkout. Its log is ``folder/server.log``.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parent.parent.parent


def get(url: str, timeout: float = HANG_GUARD_S):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    def __init__(self, folder: Path, yaml_entries: dict | None = None, args=(),
                 start_timeout: float = HANG_GUARD_S):
        self.folder = Path(folder)
        (self.folder / "custom_nodes").mkdir(parents=True, exist_ok=True)
        (self.folder / "custom_nodes" / "sdslim").symlink_to(ROOT)
        dirs = {name: self.folder / name for name in ("input", "output", "temp", "user")}
        for d in dirs.values():
            d.mkdir(exist_ok=True)
        lines = ["test:", f"  custom_nodes: {self.folder / 'custom_nodes'}"]
        lines += [f"  {kind}: {path}" for kind, path in (yaml_entries or {}).items()]
        (self.folder / "extra.yaml").write_text("\n".join(lines) + "\n")
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = self.folder / "server.log"
        self._log = open(self.log_path, "w")
        argv = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
                "--extra-model-paths-config", str(self.folder / "extra.yaml"),
                "--database-url", f"sqlite:///{self.folder / 'user' / 'comfyui.db'}"]
        argv += [a for name, d in dirs.items() for a in (f"--{name}-directory", str(d))]
        self.proc = subprocess.Popen(argv + list(args), cwd=os.environ["COMFYUI_PATH"], stdout=self._log,
                                     stderr=subprocess.STDOUT)
        try:
            self._wait_started(time.monotonic() + start_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_started(self, deadline: float):
        while True:
            try:
                self.get("/system_stats")
                return
            except OSError:
                assert self.proc.poll() is None, self.log()[-3000:]
                assert time.monotonic() < deadline, "ComfyUI did not start: " + self.log()[-3000:]
                time.sleep(0.5)

    def get(self, path: str):
        return get(self.base + path)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def log_since_start(self) -> str:
        """The log after the start-up (which reports custom nodes and ComfyUI's own optional imports)."""
        text = self.log()
        return text[text.find("To see the GUI go to"):]

    def queue(self, prompt: dict, client_id: str | None = None) -> str:
        """POST /prompt; the prompt id."""
        body = {"prompt": prompt} | ({"client_id": client_id} if client_id else {})
        req = urllib.request.Request(self.base + "/prompt", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=HANG_GUARD_S) as r:
            return json.load(r)["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = HANG_GUARD_S) -> dict:
        """The /history entry of ``prompt_id`` once it has run."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            history = self.get(f"/history/{prompt_id}")
            if prompt_id in history:
                return history[prompt_id]
            time.sleep(0.05)
        raise AssertionError(f"prompt {prompt_id} did not finish in {timeout} s: {self.log()[-3000:]}")

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=HANG_GUARD_S)
        finally:
            self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
