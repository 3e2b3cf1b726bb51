"""Stand-in for ``modules.script_callbacks``: registrars and the fire functions the tests need."""
import sys

standin_callbacks = {}


def _add(category, callback, name):
    standin_callbacks.setdefault(category, []).append((name, callback))


def _fire(category, *args, reverse=False):
    entries = list(standin_callbacks.get(category, []))
    for _, callback in (reversed(entries) if reverse else entries):
        try:
            callback(*args)
        except Exception as err:  # upstream reports and carries on
            print(f"Error executing callback {category}: {err}", file=sys.stderr)


def clear_callbacks():
    standin_callbacks.clear()


def on_ui_settings(callback, *, name=None):
    _add("ui_settings", callback, name)


def on_ui_tabs(callback, *, name=None):
    _add("ui_tabs", callback, name)


def on_model_loaded(callback, *, name=None):
    _add("model_loaded", callback, name)


def on_before_reload(callback, *, name=None):
    _add("before_reload", callback, name)


def on_script_unloaded(callback, *, name=None):
    _add("script_unloaded", callback, name)


def ui_settings_callback():
    _fire("ui_settings")


def ui_tabs_callback():
    """The (component, title, elem_id) tuples every registered tab callback returns."""
    res = []
    for _, callback in standin_callbacks.get("ui_tabs", []):
        res += callback() or []
    return res


def model_loaded_callback(sd_model):
    _fire("model_loaded", sd_model)


def app_reload_callback():
    _fire("before_reload")


def script_unloaded_callback():
    _fire("script_unloaded", reverse=True)
