"""Publishing metadata: the Comfy Registry's `[tool.comfy]` in pyproject.toml and the A1111 extension-index entry
(publish/a1111-index/sdslim.json), against the rules of the registry's specification page and of the index
repository's own validator (AUTOMATIC1111/stable-diffusion-webui-extensions, .github/scripts/validate.py)."""
import datetime
import json
import os
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the index repository's tags.json keys
A1111_TAGS = {"script", "localization", "tab", "dropdown", "ads", "installed", "training", "models", "UI related",
              "prompting", "editing", "manipulations", "online", "animation", "query", "science", "extras"}


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_comfy_registry_metadata():
    data = _pyproject()
    project, comfy = data["project"], data["tool"]["comfy"]
    # [project] name: < 100 characters, alphanumerics . _ -, no consecutive specials, starts with a letter
    assert len(project["name"]) < 100 and re.fullmatch(r"[A-Za-z](?:[A-Za-z0-9]|[._-](?![._-]))*", project["name"])
    assert "comfyui" not in project["name"].lower()
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    repo = project["urls"]["Repository"]
    owner_repo = re.fullmatch(r"https://github\.com/([\w.-]+/[\w.-]+)", repo)[1]
    assert re.fullmatch(r"[a-z][a-z0-9-]*", comfy["PublisherId"]) and comfy["DisplayName"].strip()
    # Icon: a URL of a square image of at most 400 px, here a raw GitHub URL of a file in this repository
    m = re.fullmatch(rf"https://raw\.githubusercontent\.com/{re.escape(owner_repo)}/main/(.+\.png)", comfy["Icon"])
    assert m, comfy["Icon"]
    with open(os.path.join(ROOT, m[1]), "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    assert width == height <= 400


def test_a1111_extension_index_entry():
    with open(os.path.join(ROOT, "publish", "a1111-index", "sdslim.json")) as f:
        entry = json.load(f)
    assert {"name", "url", "description", "tags"} <= set(entry)
    assert entry["tags"] and set(entry["tags"]) <= A1111_TAGS
    datetime.date.fromisoformat(entry["added"])
    assert re.fullmatch(r"(https://[^ ]+?)(?:\.git)?", entry["url"])
    assert entry["url"].removesuffix(".git") == _pyproject()["project"]["urls"]["Repository"]
    assert 20 < len(entry["description"]) <= 300
