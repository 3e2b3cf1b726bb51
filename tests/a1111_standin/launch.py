"""Stand-in for the webui's ``launch`` module as seen by an extension's install.py: records pip calls."""
import importlib.metadata
import importlib.util

standin_pip_calls = []


def is_installed(package):
    """Installed by distribution name, else importable by module name (as upstream checks)."""
    try:
        importlib.metadata.distribution(package)
        return True
    except importlib.metadata.PackageNotFoundError:
        try:
            return importlib.util.find_spec(package) is not None
        except ModuleNotFoundError:
            return False


def run_pip(command, desc=None, live=False):
    standin_pip_calls.append((command, desc))
    return ""
