"""The A1111 stand-in and scripts/sdslim.py against names and signatures recorded from webui v1.10.1 and
gradio 3.41.2 (tests/data/a1111_v1.10.1_signatures.json, built by tests/a1111_standin/record_signatures.py)."""
import ast
import dataclasses
import importlib
import inspect
import json
import os

import pytest

from a1111_standin.harness import ROOT, SCRIPT, load_script, one_thread, webui  # noqa: F401 (fixtures)

RECORDED = json.load(open(os.path.join(ROOT, "tests", "data", "a1111_v1.10.1_signatures.json"), encoding="utf8"))
WEBUI = RECORDED["webui"]
GRADIO = RECORDED["gradio"]
DATACLASS_GENERATED = {"__init__", "__repr__", "__eq__"}


def _resolve(module, name):
    """The recorded entry for ``module.name``, following aliases (``shared.OptionInfo`` → ``options.OptionInfo``)."""
    entry = WEBUI[module][name]
    if entry["kind"] in ("alias", "import"):
        target_mod, _, target_name = entry["target"].rpartition(".")
        for candidate in (target_mod, f"modules.{target_mod}", target_mod.replace("modules.", "", 1)):
            if candidate in WEBUI and target_name in WEBUI[candidate]:
                return _resolve(candidate, target_name)
    return entry


def _recorded_signature(params, drop_self=False):
    out = []
    for name, kind, default in params[1 if drop_self else 0:]:
        extra = {} if default is None else {"default": _default_value(default)}
        out.append(inspect.Parameter(name, getattr(inspect.Parameter, kind), **extra))
    return inspect.Signature(out)


class _Expr:
    """A recorded default that is an expression (not a literal): only its presence is compared."""

    def __init__(self, src):
        self.src = src

    def __repr__(self):
        return self.src


def _default_value(src):
    try:
        return ast.literal_eval(src)
    except ValueError:
        return _Expr(src)


def _same_signature(where, func, recorded_params):
    got = inspect.signature(func)
    want = _recorded_signature(recorded_params)
    assert [(p.name, p.kind) for p in got.parameters.values()] == \
           [(p.name, p.kind) for p in want.parameters.values()], f"{where}: {got} != recorded {want}"
    for g, w in zip(got.parameters.values(), want.parameters.values()):
        assert (g.default is inspect.Parameter.empty) == (w.default is inspect.Parameter.empty), \
            f"{where}: default of {g.name}: {got} != recorded {want}"
        if not isinstance(w.default, _Expr) and w.default is not inspect.Parameter.empty:
            assert g.default == w.default, f"{where}: default of {g.name} is {g.default!r}, recorded {w.default!r}"


def _attributes(module, entry):
    """Recorded attributes of a class and of its recorded base classes in the same module."""
    out = set(entry["attributes"])
    for base in entry["bases"]:
        if base in WEBUI[module]:
            out |= _attributes(module, WEBUI[module][base])
    return out


def _check_class(where, cls, entry):
    assert entry["kind"] == "class", f"{where}: recorded as {entry['kind']}"
    generated = DATACLASS_GENERATED if dataclasses.is_dataclass(cls) else set()
    attributes = _attributes(where.rpartition(".")[0], entry)
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for name in fields:
        assert name in attributes or name.startswith("standin_"), f"{where}.{name}: not an upstream field"
    for name, value in vars(cls).items():
        if name.startswith("standin_") or name in generated or name in fields:
            continue
        if isinstance(value, property):
            assert name in attributes, f"{where}.{name}: not an upstream attribute"
        elif inspect.isfunction(value) or isinstance(value, staticmethod):
            if name.startswith("_") and not name.startswith("__"):
                continue
            if name.startswith("__") and name not in entry["methods"]:
                continue  # stand-in plumbing (__enter__ …) the recorded class does not define
            assert name in entry["methods"], f"{where}.{name}: not an upstream method"
            _same_signature(f"{where}.{name}", value, entry["methods"][name]["params"])
        elif not name.startswith("__") and not name.startswith("_"):
            assert name in attributes, f"{where}.{name}: not an upstream class attribute"


STANDIN_MODULES = sorted(m for m in WEBUI if m != "modules.launch_utils")  # launch re-exports launch_utils


@pytest.mark.parametrize("module_name", STANDIN_MODULES)
def test_standin_matches_recorded(webui, module_name):
    """Every public name a stand-in module defines exists upstream with the same signature."""
    module = importlib.import_module(module_name)
    recorded = WEBUI[module_name]
    checked = 0
    for name, value in vars(module).items():
        if name.startswith("_") or name.startswith("standin_") or inspect.ismodule(value):
            continue
        own = getattr(value, "__module__", module.__name__) == module.__name__
        if (inspect.isclass(value) or inspect.isfunction(value)) and not own and name not in recorded:
            continue  # imported helper (dataclass, Any …)
        assert name in recorded, f"{module_name}.{name}: not in the recorded v1.10.1 names"
        entry = _resolve(module_name, name)
        if inspect.isclass(value) and entry["kind"] == "value":
            assert issubclass(value, tuple) and hasattr(value, "_fields"), \
                f"{module_name}.{name}: a class here, a value upstream (only a namedtuple may be both)"
        elif inspect.isclass(value):
            _check_class(f"{module_name}.{name}", value, entry)
        elif inspect.isfunction(value):
            assert entry["kind"] == "function", f"{module_name}.{name}: recorded as {entry['kind']}"
            _same_signature(f"{module_name}.{name}", value, entry["params"])
        checked += 1
    assert checked, f"{module_name}: the stand-in defines none of the recorded names"


def test_standin_defines_every_name_the_script_reads(webui):
    for module, names in _script_uses().items():
        standin = importlib.import_module(f"modules.{module}")
        for name in names:
            assert hasattr(standin, name), f"stand-in modules.{module} lacks {name}, which the script reads"


def _script_tree():
    with open(SCRIPT, encoding="utf8") as f:
        return ast.parse(f.read())


def _script_uses():
    """{webui module alias: names the script reads from it} for ``from modules import x`` imports."""
    tree = _script_tree()
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "modules":
            for a in node.names:
                aliases[a.asname or a.name] = a.name
    uses = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            uses.setdefault(aliases[node.value.id], set()).add(node.attr)
    return uses


def test_script_reads_only_recorded_webui_names():
    uses = _script_uses()
    assert {"scripts", "shared", "script_callbacks"} <= set(uses)
    for module, names in uses.items():
        recorded = WEBUI.get(f"modules.{module}")
        assert recorded is not None, f"the script imports modules.{module}, which was not recorded"
        for name in names:
            assert name in recorded, f"modules.{module}.{name} does not exist in webui v1.10.1"


def _bind(where, signature, call):
    args = [object()] * len(call.args)
    if any(isinstance(a, ast.Starred) for a in call.args):
        return  # *args: arity unknown statically
    kwargs = {k.arg: object() for k in call.keywords if k.arg is not None}
    named = {n for n, p in signature.parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    unknown = set(kwargs) - named
    assert not unknown, f"{where} at line {call.lineno}: {sorted(unknown)} not parameters of {signature}"
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        pytest.fail(f"{where} at line {call.lineno}: {err} (recorded {signature})")


def test_script_calls_bind_to_recorded_signatures():
    """Calls of webui functions, OptionInfo/Options methods and gradio components fit the recorded parameters."""
    calls = 0
    options = _resolve("modules.options", "Options")["methods"]
    option_info = _resolve("modules.shared", "OptionInfo")
    for node in ast.walk(_script_tree()):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if isinstance(f.value, ast.Name) and f.value.id == "gr":
            assert f.attr in GRADIO, f"gr.{f.attr} was not recorded from gradio 3.41.2"
            entry = GRADIO[f.attr]
            if f.attr == "update":          # gr.update(**kwargs): properties of the recorded components
                known = {p[0] for e in GRADIO.values() if e["kind"] == "class" for p in e["methods"]["__init__"]["params"]}
                unknown = {k.arg for k in node.keywords} - known
                assert not node.args and not unknown, f"gr.update at line {node.lineno}: {unknown}"
            elif entry["kind"] == "function":
                _bind(f"gr.{f.attr}", _recorded_signature(entry["params"]), node)
            else:
                _bind(f"gr.{f.attr}", _recorded_signature(entry["methods"]["__init__"]["params"], True), node)
        elif isinstance(f.value, ast.Name) and f"modules.{f.value.id}" in WEBUI and f.attr in WEBUI[f"modules.{f.value.id}"]:
            entry = _resolve(f"modules.{f.value.id}", f.attr)
            if entry["kind"] == "function":
                _bind(f"{f.value.id}.{f.attr}", _recorded_signature(entry["params"]), node)
            elif entry["kind"] == "class" and "__init__" not in entry["methods"]:    # a dataclass: its fields
                unknown = {k.arg for k in node.keywords} - _attributes(f"modules.{f.value.id}", entry)
                assert not node.args and not unknown, f"{f.value.id}.{f.attr} at line {node.lineno}: {unknown}"
            elif entry["kind"] == "class":
                _bind(f"{f.value.id}.{f.attr}", _recorded_signature(entry["methods"]["__init__"]["params"], True), node)
        elif isinstance(f.value, ast.Name) and f.value.id == "opts" and f.attr in options:
            _bind(f"opts.{f.attr}", _recorded_signature(options[f.attr]["params"], True), node)
        elif f.attr in option_info["methods"] and isinstance(f.value, ast.Call):
            _bind(f"OptionInfo.{f.attr}", _recorded_signature(option_info["methods"][f.attr]["params"], True), node)
        else:
            continue
        calls += 1
    assert calls >= 15, f"only {calls} webui/gradio calls found: is the script still using them?"


# Keyword arguments the v1.10.1 ScriptRunner passes to each hook (besides p and the script's UI values).
RUNNER_KWARGS = {
    "before_process": {}, "process": {}, "before_hr": {},
    "process_before_every_sampling": {"x": 0, "noise": 0, "c": 0, "uc": 0},
    "process_batch": {"batch_number": 0, "prompts": [], "seeds": [], "subseeds": []},
    "before_process_batch": {"batch_number": 0, "prompts": [], "seeds": [], "subseeds": []},
    "postprocess_batch": {"images": [], "batch_number": 0},
}


def test_script_hooks_are_upstream_hooks_and_accept_the_runner_call(webui):
    module = load_script()
    cls = module.SdSlimScript
    recorded = WEBUI["modules.scripts"]["Script"]["methods"]
    script = cls()
    hooks = [n for n, v in vars(cls).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"title", "show", "ui", "process_before_every_sampling", "postprocess"} <= set(hooks)
    ui_values = ["Settings", "Settings", 0.0]
    assert len(script.ui(False)) == len(ui_values)
    for name in hooks:
        assert name in recorded, f"SdSlimScript.{name} is not a Script method in webui v1.10.1 (typo?)"
        if name in RUNNER_KWARGS:
            inspect.signature(getattr(script, name)).bind(object(), *ui_values, **RUNNER_KWARGS[name])
    inspect.signature(script.postprocess).bind(object(), object(), *ui_values)


def test_the_lora_reader_reads_only_recorded_attributes():
    """sdslim_core.hosts.a1111.lora reads the Lora extension's network modules by attribute: each one it reads exists in
    the recorded v1.10.1 classes (their own or NetworkModule's), as do the methods it calls."""
    from sdslim_core.hosts.a1111 import lora as a1111_lora
    base = WEBUI["network"]["NetworkModule"]
    shared = set(base["attributes"]) | set(base["methods"])
    for cls, (_, attrs) in a1111_lora._ATTRIBUTES.items():
        module = next(m for m, names in WEBUI.items() if cls in names)
        entry = WEBUI[module][cls]
        assert entry["bases"] == ["network.NetworkModule"], cls
        for attr in attrs.values():
            assert attr in set(entry["attributes"]) | shared, f"{cls}.{attr} is not in webui v1.10.1"
    assert {"dora_scale", "bias", "network", "network_key", "multiplier", "calc_scale"} <= shared
    assert "dyn_dim" in WEBUI["network"]["Network"]["attributes"]


def test_training_reads_and_sets_only_recorded_job_state():
    """sdslim_core.hosts.a1111.training and the script use ``shared.state`` by attribute: every field they read or
    set, and every method the script calls on it, is one of v1.10.1's ``shared_state.State``."""
    from sdslim_core.hosts.a1111 import training

    state = WEBUI["modules.shared_state"]["State"]
    used = set()

    class Recorder:
        def __getattr__(self, name):
            used.add(name)
            return 0

        def __setattr__(self, name, value):
            used.add(name)
            object.__setattr__(self, name, value)
    rec = Recorder()
    job = training.JobProgress(rec)
    job(1, 2, {"stage": 1, "loss": 0.5})
    training.busy(rec)
    assert {"job", "job_count", "job_no", "sampling_step", "sampling_steps", "textinfo", "interrupted"} <= used
    assert used <= set(state["attributes"]), sorted(used - set(state["attributes"]))
    for node in ast.walk(_script_tree()):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and ast.unparse(node.value) == "shared.state":
            assert node.attr in set(state["attributes"]) | set(state["methods"]), f"shared.state.{node.attr}"
