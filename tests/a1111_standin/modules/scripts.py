"""Stand-in for ``modules.scripts``: the Script base class and a ScriptRunner that calls hooks as upstream does
(``script.<hook>(p, *p.script_args[script.args_from:script.args_to], **kwargs)``)."""
import os
import sys

AlwaysVisible = object()


class PostSampleArgs:
    def __init__(self, samples):
        self.samples = samples


class PostprocessImageArgs:
    def __init__(self, image):
        self.image = image


class PostprocessBatchListArgs:
    def __init__(self, images):
        self.images = images


class Script:
    name = None
    section = None
    filename = None
    args_from = None
    args_to = None
    alwayson = False
    is_txt2img = False
    is_img2img = False
    tabname = None
    group = None
    create_group = True
    infotext_fields = None
    paste_field_names = None
    api_info = None
    on_before_component_elem_id = None
    on_after_component_elem_id = None
    setup_for_ui_only = False
    controls = None

    def title(self):
        raise NotImplementedError()

    def ui(self, is_img2img):
        pass

    def show(self, is_img2img):
        return True

    def run(self, p, *args):
        pass

    def setup(self, p, *args):
        pass

    def before_process(self, p, *args):
        pass

    def process(self, p, *args):
        pass

    def before_process_batch(self, p, *args, **kwargs):
        pass

    def after_extra_networks_activate(self, p, *args, **kwargs):
        pass

    def process_before_every_sampling(self, p, *args, **kwargs):
        pass

    def process_batch(self, p, *args, **kwargs):
        pass

    def postprocess_batch(self, p, *args, **kwargs):
        pass

    def postprocess_batch_list(self, p, pp, *args, **kwargs):
        pass

    def post_sample(self, p, ps, *args):
        pass

    def postprocess_image(self, p, pp, *args):
        pass

    def postprocess(self, p, processed, *args):
        pass

    def before_component(self, component, **kwargs):
        pass

    def after_component(self, component, **kwargs):
        pass

    def describe(self):
        return ""

    def elem_id(self, item_id):
        title = "".join(c for c in self.title().lower().replace(" ", "_") if c.isalnum() or c == "_")
        tab = "img2img" if self.is_img2img else "txt2img"
        return f"script_{tab}_{title}_{item_id}"

    def before_hr(self, p, *args):
        pass


def basedir():
    """The directory of the extension whose script is being loaded (the repository root here)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class ScriptRunner:
    def __init__(self):
        self.scripts = []
        self.alwayson_scripts = []
        self.standin_args = [None]  # slot 0: the selected (non-always-on) script, as upstream

    def standin_add(self, script, is_img2img=False):
        """Register an always-on script: build its UI, record its arg slice and default values."""
        script.is_txt2img, script.is_img2img = not is_img2img, is_img2img
        script.tabname = "img2img" if is_img2img else "txt2img"
        if script.show(is_img2img) is not AlwaysVisible:
            raise ValueError(f"{script.title()}: show() must return scripts.AlwaysVisible")
        script.alwayson = True
        controls = script.ui(is_img2img)
        if controls is None:
            raise ValueError(f"{script.title()}: ui() returned None (upstream then skips the script)")
        script.name = script.title().lower()
        script.args_from = len(self.standin_args)
        self.standin_args.extend(getattr(c, "value", None) for c in controls)
        script.args_to = len(self.standin_args)
        script.controls = controls
        self.scripts.append(script)
        self.alwayson_scripts.append(script)

    def _call(self, method, p, *extra, **kwargs):
        for script in self.alwayson_scripts:
            try:
                getattr(script, method)(p, *extra, *p.script_args[script.args_from:script.args_to], **kwargs)
            except Exception as err:  # upstream: errors.report(...) and carry on
                print(f"Error running {method}: {script.filename}: {err!r}", file=sys.stderr)
                p.standin_script_errors.append((method, err))

    def before_process(self, p):
        self._call("before_process", p)

    def process(self, p):
        self._call("process", p)

    def process_before_every_sampling(self, p, **kwargs):
        self._call("process_before_every_sampling", p, **kwargs)

    def before_process_batch(self, p, **kwargs):
        self._call("before_process_batch", p, **kwargs)

    def after_extra_networks_activate(self, p, **kwargs):
        self._call("after_extra_networks_activate", p, **kwargs)

    def process_batch(self, p, **kwargs):
        self._call("process_batch", p, **kwargs)

    def postprocess(self, p, processed):
        self._call("postprocess", p, processed)

    def postprocess_batch(self, p, images, **kwargs):
        self._call("postprocess_batch", p, images=images, **kwargs)

    def post_sample(self, p, ps):
        self._call("post_sample", p, ps)

    def before_hr(self, p):
        self._call("before_hr", p)
