"""Progress output: tqdm's bars on a terminal; without one (a log, nohup, CI) one plain line per 5 % of a phase or
per 30 s, whichever comes first, with the bar's fields and no carriage return (the clock is simulated)."""
import io
import re

import pytest

from sdslim_core import cli, tiny
from sdslim_core.train import progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(progress, "clock", lambda: now[0])
    return now


def _stage(monkeypatch, clock, total, seconds_per_step, name=1, unit="step"):
    """The run's Progress through one stage of ``total`` steps with stderr a log file; its lines."""
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    heard = []
    p = progress.Progress(lambda done, n, info: heard.append(done), bars=True)
    p.total = total
    p.start_stage(f"stage {name}", total, unit=unit)
    for i in range(1, total + 1):
        clock[0] += seconds_per_step
        p.step(i, {"stage": name, "loss": 1 / i, "site": "input_blocks.1.1.transformer_blocks.0.ff"})
    p.end_stage()
    assert heard == list(range(1, total + 1))
    text = err.getvalue()
    assert "\r" not in text and "\x1b" not in text
    return text.splitlines()


def test_a_fast_stage_prints_a_line_per_5_percent(monkeypatch, clock):
    lines = _stage(monkeypatch, clock, 200, 0.1)
    assert len(lines) == 20
    done = [int(re.search(r" (\d+)/200 steps", line)[1]) for line in lines]
    assert done == list(range(10, 201, 10))
    assert re.fullmatch(r"stage 1:   5% 10/200 steps \[00:01<00:19, +10\.00step/s, loss=0\.1, site=\S+\]", lines[0]), \
        lines[0]
    assert lines[-1].startswith("stage 1: 100% 200/200 steps [00:20<00:00,")


def test_a_slow_stage_prints_a_line_per_30_seconds(monkeypatch, clock):
    lines = _stage(monkeypatch, clock, 1000, 7.0)                 # 5 % = 50 steps = 350 s: time comes first
    done = [int(re.search(r" (\d+)/1000 steps", line)[1]) for line in lines]
    assert done[:4] == [5, 10, 15, 20] and done[-1] == 1000       # 35 s, then every 5 steps (35 s) after
    assert all(b - a == 5 for a, b in zip(done, done[1:-1]))


def test_a_phase_of_unknown_size_and_messages_between_lines(monkeypatch, clock):
    err = io.StringIO()
    bar = progress.Bar(None, "capture", unit="input", file=err)
    for _ in range(100):
        clock[0] += 1.0
        bar.update(3)
    progress.write("a message", file=err)
    bar.close()
    lines = err.getvalue().splitlines()
    assert lines[:3] == ["capture: 90 inputs [00:30,  3.00input/s]", "capture: 180 inputs [01:00,  3.00input/s]",
                         "capture: 270 inputs [01:30,  3.00input/s]"]
    assert lines[3:] == ["a message", "capture: 300 inputs [01:40,  3.00input/s]"]


def test_a_terminal_gets_tqdms_bar():
    term = Terminal()
    assert progress.on_terminal(term) and not progress.on_terminal(io.StringIO())
    bar = progress.Bar(50, "init", unit="site", file=term)
    for _ in range(50):
        bar.update(1)
    bar.close()
    assert "\r" in term.getvalue() and "init: 100%|" in term.getvalue()


def test_sdslim_slim_in_a_log_prints_plain_fold_lines(tmp_path, capsys):
    out = tmp_path / "slim.safetensors"
    assert cli.main(["slim", "--ckpt", str(tiny.DEFAULT_PATH), "--adapters",
                     str(tiny.ASSETS / "tiny_sd15_slim_half.safetensors"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    folding = [line for line in err.splitlines() if line.startswith("folding:")]
    assert "\r" not in err and folding and folding[-1].startswith("folding: 100% ") and "sites [" in folding[-1], err
