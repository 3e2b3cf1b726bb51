"""The `sdslim` entry point: a command module that fails to import is reported, never skipped."""
import sys

import pytest

from sdslim_core import cli


@pytest.fixture
def broken_command(tmp_path, monkeypatch):
    (tmp_path / "sdslim_broken_cmd.py").write_text("import sdslim_no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMAND_MODULES", cli.COMMAND_MODULES + ("sdslim_broken_cmd",))
    yield
    sys.modules.pop("sdslim_broken_cmd", None)


def test_broken_command_module_raises_a_clear_error(broken_command):
    with pytest.raises(cli.CommandImportError, match="sdslim_broken_cmd failed to import.*sdslim_no_such_module"):
        cli.build_parser()


def test_broken_command_module_main_reports_it(broken_command, capsys):
    assert cli.main(["breakdown", "--help"]) == 1
    assert "sdslim_broken_cmd failed to import" in capsys.readouterr().err


def test_all_commands_register():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert {"breakdown", "train", "slim", "lora", "eval", "vram", "demo", "ui"} <= set(sub.choices)
