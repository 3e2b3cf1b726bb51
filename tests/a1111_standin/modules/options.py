"""Stand-in for ``modules.options``: OptionInfo, Options (data + labels, defaults, onchange, set)."""


class OptionInfo:
    def __init__(self, default=None, label='', component=None, component_args=None, onchange=None, section=None,
                 refresh=None, comment_before='', comment_after='', infotext=None, restrict_api=False,
                 category_id=None):
        self.default = default
        self.label = label
        self.component = component
        self.component_args = component_args
        self.onchange = onchange
        self.section = section
        self.category_id = category_id
        self.refresh = refresh
        self.do_not_save = False
        self.comment_before = comment_before
        self.comment_after = comment_after
        self.infotext = infotext
        self.restrict_api = restrict_api

    def link(self, label, url):
        self.comment_before += f"[<a href='{url}' target='_blank'>{label}</a>]"
        return self

    def js(self, label, js_func):
        self.comment_before += f"[<a onclick='{js_func}(); return false'>{label}</a>]"
        return self

    def info(self, info):
        self.comment_after += f"<span class='info'>({info})</span>"
        return self

    def html(self, html):
        self.comment_after += html
        return self

    def needs_restart(self):
        self.comment_after += " <span class='info'>(requires restart)</span>"
        return self

    def needs_reload_ui(self):
        self.comment_after += " <span class='info'>(requires Reload UI)</span>"
        return self


def options_section(section_identifier, options_dict):
    """Attach ``section_identifier`` (id, label[, category]) to every option of ``options_dict``."""
    for v in options_dict.values():
        if len(section_identifier) == 2:
            v.section = section_identifier
        elif len(section_identifier) == 3:
            v.section = section_identifier[0:2]
            v.category_id = section_identifier[2]
    return options_dict


class Options:
    typemap = {int: float}

    def __init__(self, data_labels, restricted_opts):
        self.__dict__["data_labels"] = data_labels
        self.__dict__["data"] = {k: v.default for k, v in data_labels.items() if not v.do_not_save}
        self.__dict__["restricted_opts"] = restricted_opts

    def __setattr__(self, key, value):
        if key in self.data_labels:
            self.data[key] = value
            return
        super().__setattr__(key, value)

    def __getattr__(self, item):
        if item in self.__dict__["data"]:
            return self.__dict__["data"][item]
        if item in self.__dict__["data_labels"]:
            return self.__dict__["data_labels"][item].default
        raise AttributeError(item)

    def set(self, key, value, is_api=False, run_callbacks=True):
        """Set an option; returns whether the value changed; runs its onchange callback."""
        old = self.data.get(key)
        if old == value:
            return False
        info = self.data_labels.get(key)
        if info is not None and info.do_not_save:
            return False
        self.data[key] = value
        if run_callbacks and info is not None and info.onchange is not None:
            try:
                info.onchange()
            except Exception:
                self.data[key] = old
                raise
        return True

    def get_default(self, key):
        info = self.data_labels.get(key)
        return None if info is None else info.default

    def add_option(self, key, info):
        self.data_labels[key] = info
        if key not in self.data and not info.do_not_save:
            self.data[key] = info.default

    def onchange(self, key, func, call=True):
        """Replace the option's single onchange callback."""
        self.data_labels[key].onchange = func
        if call:
            func()

    def cast_value(self, key, value):
        """Cast an infotext string to the option's type (as pasted parameters are)."""
        if value is None:
            return None
        default = self.get_default(key)
        if default is None:
            return value
        if isinstance(default, bool):
            return value == "True" if isinstance(value, str) else bool(value)
        return type(default)(value)
