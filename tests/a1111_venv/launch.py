"""The webui's ``launch`` as install.py uses it, running pip for real (``tests/a1111_venv/build.py`` puts it on
PYTHONPATH): ``is_installed`` by distribution name, else module name; ``run_pip`` runs ``python -m pip COMMAND
--prefer-binary`` through the shell and raises RuntimeError when pip fails, as webui v1.10.1 does."""
import importlib.metadata
import importlib.util
import subprocess
import sys


def is_installed(package):
    try:
        importlib.metadata.distribution(package)
        return True
    except importlib.metadata.PackageNotFoundError:
        try:
            return importlib.util.find_spec(package) is not None
        except ModuleNotFoundError:
            return False


def run_pip(command, desc=None, live=False):
    if desc:
        print(f"Installing {desc}", flush=True)
    done = subprocess.run(f'"{sys.executable}" -m pip {command} --prefer-binary', shell=True, capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"Couldn't install {desc}: pip exited {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done.stdout
