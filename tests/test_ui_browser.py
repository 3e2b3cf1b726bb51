"""`sdslim ui` in a real browser: headless Chromium (Debian's chromium + chromium-driver) driven by Selenium,
against `sdslim ui` started here on a free loopback port. Each tab's result is checked against the CLI.

Skipped when gradio, selenium or the browser are missing (`.ci/run` installs them). With
``SDSLIM_UI_SCREENSHOTS=docs/img`` the screenshots of the README are written there (and the planner is shown on
SD1.5, which adds about a minute); otherwise they go to a temporary folder.
"""
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def _need(ok, reason):
    """Skip the module without ``ok``; fail instead under SDSLIM_REQUIRE_BROWSER=1 (set by .ci/run)."""
    if ok:
        return
    if os.environ.get("SDSLIM_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason}; SDSLIM_REQUIRE_BROWSER=1 needs the browser tests to run", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


_need(importlib.util.find_spec("gradio"), "gradio is not installed (pip install -e '.[ui]')")
_need(importlib.util.find_spec("selenium"), "selenium is not installed (pip install -r requirements-dev.txt)")
_need(os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK),
      "headless Chromium is not installed (apt-get install chromium chromium-driver; .ci/run does it)")

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

from conftest import HANG_GUARD_S  # noqa: E402
from sdslim_core import cli  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(REPO, "sdslim_core", "tiny", "assets")
SHOTS = os.environ.get("SDSLIM_UI_SCREENSHOTS")


# ---------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The one folder the UI may use: the tiny shipped model, its LoRA, data-free adapters and a broken file."""
    from sdslim_core import layout
    from sdslim_core.io import adapters
    from sdslim_core.layout import rank_policy
    from sdslim_core.modules.unet import open_checkpoint
    d = tmp_path_factory.mktemp("models")
    for name in ("tiny_sd15.safetensors", "tiny_lora_green.safetensors"):
        shutil.copy(os.path.join(ASSETS, name), d / name)
    ck = open_checkpoint(d / "tiny_sd15.safetensors")
    w = {k: ck.weights[k] for k in ck.weights.keys()}
    adapters.AdapterSet.init_select(w, rank_policy.ranks_for_ratio(layout.sites(w), 0.5), "sd15").save(
        d / "tiny_adapters.safetensors")
    (d / "broken_adapters.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def server(root, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("ui_log") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sdslim_core.cli", "ui", "--port", str(port),
                                 "--root", str(root)], stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=str(root))
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        try:
            with urllib.request.urlopen(url, timeout=HANG_GUARD_S) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"sdslim ui did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()


class Page:
    """The app as a user sees it: widgets found by their elem_id."""

    def __init__(self, driver, shots):
        self.d, self.shots = driver, shots

    def el(self, elem_id, css="", timeout=HANG_GUARD_S):
        """The first element matching ``#elem_id css``, once it is there (widgets appear after a server round trip)."""
        selector = ", ".join(f"#{elem_id} {c.strip()}".strip() for c in css.split(","))
        return self.wait(lambda: self.d.find_elements(By.CSS_SELECTOR, selector), timeout, selector)[0]

    def tab(self, label):
        next(b for b in self.d.find_elements(By.CSS_SELECTOR, "button[role=tab]") if b.text == label).click()
        time.sleep(0.3)

    def radio(self, elem_id, label):
        next(x for x in self.d.find_elements(By.CSS_SELECTOR, f"#{elem_id} label") if x.text == label).click()
        time.sleep(0.3)

    def choose(self, elem_id, label):
        """Pick the dropdown option shown as ``label``."""
        box = self.el(elem_id, "input")
        box.click()
        option = f'#{elem_id} li[aria-label="{label}"]'
        self.wait(lambda: self.d.find_elements(By.CSS_SELECTOR, option), HANG_GUARD_S,
                  f"option {label} of {elem_id}")[0].click()
        time.sleep(0.2)

    def type_into(self, elem_id, value, css="input, textarea"):
        box = self.el(elem_id, css)
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.DELETE)
        box.send_keys(str(value))
        box.send_keys(Keys.TAB)
        time.sleep(0.2)

    def custom_value(self, elem_id, value):
        box = self.el(elem_id, "input")
        box.click()
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(str(value) + Keys.ENTER)
        box.send_keys(Keys.TAB)
        time.sleep(0.3)

    def click(self, elem_id):
        self.el(elem_id).click()

    def text(self, elem_id) -> str:
        """The rendered text of a Markdown widget (without gradio's progress overlay)."""
        return self.el(elem_id, "[data-testid=markdown]").text

    def table(self, elem_id) -> list[list[str]]:
        """The cells of the table in a Markdown widget (read again if it re-renders meanwhile)."""
        for _ in range(5):
            try:
                return [[c.text for c in tr.find_elements(By.CSS_SELECTOR, "th, td")]
                        for tr in self.d.find_elements(By.CSS_SELECTOR, f"#{elem_id} tr")]
            except StaleElementReferenceException:
                time.sleep(0.3)
        raise AssertionError(f"the table of {elem_id} kept changing")

    def wait(self, predicate, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")

    def press(self, button_id, status_id, word, timeout=HANG_GUARD_S):
        """Click a button and wait until the status changes to a text with ``word`` (or an error); returns it."""
        before = self.text(status_id)
        self.click(button_id)

        def settled():
            t = self.text(status_id)
            return t != before and (word in t or "Error" in t) and t
        return self.wait(settled, timeout, f"{status_id} to say {word!r}")

    def screenshot(self, name):
        """The whole page (beyond the window) as docs/img-style PNG ``ui_NAME.png``."""
        import base64
        self.d.execute_script("window.scrollTo(0, 0)")
        time.sleep(0.5)
        size = self.d.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
        shot = self.d.execute_cdp_cmd("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 4000), "scale": 1}})
        path = os.path.join(self.shots, f"ui_{name}.png")
        with open(path, "wb") as f:
            f.write(base64.b64decode(shot["data"]))
        return path


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="sdslim-chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--window-size=1400,1000"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(HANG_GUARD_S)
    try:
        driver.get(server)
        shots = SHOTS or str(tmp_path_factory.mktemp("ui_shots"))
        os.makedirs(shots, exist_ok=True)
        p = Page(driver, shots)
        p.wait(lambda: driver.find_elements(By.ID, "plan-run"), HANG_GUARD_S, "the app to render")
        yield p
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def run_cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------------------------- tests

def test_planner_matches_vram_estimate_json(page, root):
    """Tiny checkpoint, full fine-tune, 64 px, B=1,2: the table shows the CLI's peaks to the byte."""
    from sdslim_core.vram.estimate import BREAKDOWN_GROUPS, grouped_breakdown
    ckpt = str(root / "tiny_sd15.safetensors")
    argv = ["vram", "estimate", "--ckpt", ckpt, "--resolution", "64", "--precision", "amp-bf16", "--attention",
            "sdpa", "--optimizer", "adamw", "--batch-sizes", "1,2", "--json"]
    reference = subprocess.Popen([sys.executable, "-m", "sdslim_core.cli"] + argv, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=_env())   # runs while the UI estimates
    page.radio("plan-source", "checkpoint")
    page.choose("plan-ckpt", "tiny_sd15.safetensors")
    page.type_into("plan-batches", "1,2")
    page.type_into("plan-res", "64")
    page.type_into("plan-gpu", "0.05")
    page.click("plan-run")
    # while the estimate runs (its own process), another tab answers
    page.tab("Breakdown")
    assert "exact count" in page.press("bd-run", "bd-table", "exact count")
    assert "Done" not in page.text("plan-status"), "the estimate finished before the breakdown: nothing was shown"
    page.tab("VRAM planner")
    status = page.wait(lambda: (t := page.text("plan-status")) and ("Done" in t or "Error" in t) and t, HANG_GUARD_S,
                       "the estimate")
    assert "Done" in status, status
    out, err = reference.communicate(timeout=HANG_GUARD_S)
    assert reference.returncode == 0, err
    expected = json.loads(out)

    assert page.el("plan-command", "textarea").get_attribute("value") == "sdslim " + " ".join(argv)
    rows = page.table("plan-table")
    head = rows[0]
    assert head[:5] == ["UNet", "batch", "peak GiB", "peak bytes", "phase"] and head[5:10] == list(BREAKDOWN_GROUPS)
    assert len(rows) == 1 + len(expected["points"])
    for row, p in zip(rows[1:], expected["points"]):
        assert row[:5] == [f"original ({expected['n_params'] / 1e6:.1f}M)", str(p["batch"]), f"{p['peak_gib']:.3f}", f"{p['peak_bytes']:,}", p["phase"]]
        groups = grouped_breakdown(p["breakdown_gib"])
        assert row[5:10] == [f"{groups[g]:.3f}" for g in BREAKDOWN_GROUPS]
        assert row[10] == ("yes" if p["peak_gib"] <= 0.05 else "no")
    summary = page.text("plan-summary")
    assert f"{expected['n_params']:,} parameters" in summary
    assert f"{expected['intercept_gib']:.2f} + {expected['slope_gib']:.3f}·B GiB" in summary
    assert page.el("plan-plot", "img, svg, canvas")
    if SHOTS:   # the README picture: SD1.5 LoRA at 768 px on an 8 GiB card
        page.radio("plan-source", "family")
        page.radio("plan-task", "LoRA")
        page.type_into("plan-batches", "1,2,4,8")
        page.type_into("plan-res", "768")
        page.type_into("plan-gpu", "8")
        assert "Done" in page.press("plan-run", "plan-status", "Done")
    page.screenshot("planner")

    # the same setting again comes from the cache
    if SHOTS:
        page.radio("plan-source", "checkpoint")
        page.radio("plan-task", "full fine-tune")
        page.type_into("plan-batches", "1,2")
        page.type_into("plan-res", "64")
    assert "cached" in page.press("plan-run", "plan-status", "Done")
    # a new setting can be cancelled
    page.type_into("plan-batches", "1,2,3")
    page.click("plan-run")
    page.wait(lambda: "building" in page.text("plan-status") or "estimated" in page.text("plan-status"), HANG_GUARD_S,
              "the estimate to start")
    assert page.press("plan-cancel", "plan-status", "Cancelled.") == "Cancelled."


def test_breakdown_shows_the_seed_numbers(page, capsys):
    page.tab("Breakdown")
    page.radio("bd-mode", "seed")
    assert "seed count" in page.press("bd-run", "bd-table", "seed count")
    rc, out, _ = run_cli(capsys, "breakdown", "--arch", "sd15", "--mode", "seed", "--ratio", "0.5", "--json")
    expected = json.loads(out)
    rows = {r[0]: r[1:] for r in page.table("bd-table")}
    assert rows["component"] == ["params", "share", "slim 0.5", "ratio"]
    assert rows["ResNet"][0] == "537,670,400"          # the published SD1.5 table
    for key, label in (("resnet", "ResNet"), ("transformer", "Transformer"), ("downsample", "Downsample"),
                       ("upsample", "Upsample"), ("other", "Other"), ("total", "Total"),
                       ("feedforward", "(FeedForward)")):
        assert rows[label][0] == f"{expected[key]:,}" and rows[label][2] == f"{expected['slim'][key]:,}"
    assert page.el("bd-plot", "img, svg, canvas")
    page.screenshot("breakdown")


def test_slim_writes_a_checkpoint_that_loads(page, root, capsys, tmp_path):
    from sdslim_core.modules.unet import load_slim_unet
    from sdslim_core.io.tensors import load_file
    page.tab("Slim")
    page.choose("slim-ckpt", "tiny_sd15.safetensors")
    page.choose("slim-adapters", "tiny_adapters.safetensors")
    page.choose("slim-lora0", "tiny_lora_green.safetensors")
    page.type_into("slim-lora0-strength", "0.8")
    page.type_into("slim-name", "tiny_slim.safetensors")
    status = page.press("slim-run", "slim-status", "Wrote")
    out = root / "tiny_slim.safetensors"
    from sdslim_core.io.files import format_bytes
    shown = " ".join(status.split()).replace(" :", ":")     # the path is a code span: the browser may space it
    assert shown == f"Wrote {out}: {format_bytes(out.stat().st_size)} on disk" and out.is_file()
    unet, cfg, meta = load_slim_unet(out)
    assert meta["sdslim.loras"] == [{"file": "tiny_lora_green.safetensors", "strength": 0.8,
                                     "applied": "before folding"}]
    slim_t, _ = load_file(out)
    orig_t, _ = load_file(root / "tiny_sd15.safetensors")
    unet_numel = [sum(v.numel() for k, v in t.items() if k.startswith("model.diffusion_model."))
                  for t in (slim_t, orig_t)]
    assert sum(p.numel() for p in unet.parameters()) == unet_numel[0] < unet_numel[1]
    assert f"wrote {out}" in page.el("slim-log", "textarea").get_attribute("value")
    rc, _, _ = run_cli(capsys, "slim", "--ckpt", root / "tiny_sd15.safetensors", "--adapters",
                       root / "tiny_adapters.safetensors", "--lora", f"{root / 'tiny_lora_green.safetensors'}:0.8",
                       "--out", tmp_path / "cli.safetensors")
    ui_t, ui_meta = load_file(out)
    cli_t, cli_meta = load_file(tmp_path / "cli.safetensors")
    assert rc == 0 and ui_t.keys() == cli_t.keys() and all((ui_t[k] == cli_t[k]).all() for k in ui_t)
    assert ui_meta == cli_meta
    page.screenshot("slim")


def test_slim_bad_input_shows_the_cli_error_and_writes_nothing(page, root, capsys, tmp_path):
    page.tab("Slim")
    before = sorted(os.listdir(root))
    page.choose("slim-ckpt", "tiny_sd15.safetensors")
    page.choose("slim-adapters", "broken_adapters.safetensors")
    page.choose("slim-lora0", "— none —")
    page.type_into("slim-name", "should_not_exist.safetensors")
    shown = page.press("slim-run", "slim-status", "Error")
    rc, _, err = run_cli(capsys, "slim", "--ckpt", root / "tiny_sd15.safetensors", "--adapters",
                         root / "broken_adapters.safetensors", "--out", tmp_path / "x.safetensors")
    assert rc == 2 and shown == "Error: " + err.strip()
    assert "broken_adapters.safetensors" in shown
    # a path outside the --root folder is refused before anything is read
    page.custom_value("slim-ckpt", "/etc/hostname")
    page.choose("slim-adapters", "tiny_adapters.safetensors")
    assert "outside the folders" in page.press("slim-run", "slim-status", "Error")
    assert "/etc/hostname: outside the folders this UI may use" in page.text("slim-status")
    assert sorted(os.listdir(root)) == before and not list(tmp_path.iterdir())


def test_compare_shows_the_eval_grid_and_numbers(page, root):
    from sdslim_core.apps.evaluate import evaluate
    page.tab("Compare")
    page.choose("cmp-ckpt", "tiny_sd15.safetensors")
    page.choose("cmp-adapters", "tiny_adapters.safetensors")
    page.type_into("cmp-seeds", "2")
    page.type_into("cmp-steps", "8")
    page.click("cmp-run")
    page.wait(lambda: page.table("cmp-table") or "Error" in page.text("cmp-status"), HANG_GUARD_S, "the comparison")
    rows = {r[0]: r[1] for r in page.table("cmp-table")}
    ref = evaluate(root / "tiny_sd15.safetensors", root / "tiny_adapters.safetensors", seeds=2, steps=8)
    shown = float(rows["image PSNR"].split()[0])
    assert shown == pytest.approx(ref["image"]["psnr_db"], rel=2e-3)
    params = ref["params"]
    assert rows["UNet parameters teacher → slim"].startswith(f"{params['teacher']:,} → {params['slim']:,}")
    img = page.el("cmp-image", "img")
    assert img.get_attribute("naturalWidth") not in (None, "0")
    page.screenshot("compare")


def test_no_file_is_served_by_path(server, root):
    """gradio's file route serves no file of the --root folder or of the machine (only its own cache)."""
    import urllib.error
    for path in (root / "tiny_sd15.safetensors", "tiny_sd15.safetensors", "/etc/passwd",
                 os.path.join(REPO, "README.md")):
        try:
            with urllib.request.urlopen(f"{server}gradio_api/file={path}", timeout=HANG_GUARD_S) as r:
                status = r.status
        except urllib.error.HTTPError as err:
            status = err.code
        assert status in (403, 404), (path, status)
