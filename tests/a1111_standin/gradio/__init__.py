"""Stand-in for gradio 3.41 as used by extension UIs: components record their arguments; layouts are
context managers; ``click`` records the wiring so tests can call the handler."""

standin_created = []            # every component and layout, in creation order


class _Block:
    def __init__(self, *args, **kwargs):
        standin_created.append(self)
        self.args, self.kwargs = args, kwargs
        self.value = kwargs.get("value", self._positional_value(args))
        self.events = []

    @staticmethod
    def _positional_value(args):
        return args[0] if args else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def click(self, fn=None, inputs=None, outputs=None, **kwargs):
        self.events.append(("click", fn, inputs, outputs))
        return self


class Accordion(_Block):
    pass


class Row(_Block):
    pass


class Column(_Block):
    pass


class Blocks(_Block):
    pass


class Textbox(_Block):
    pass


class Number(_Block):
    pass


class Button(_Block):
    pass


class HTML(_Block):
    pass


class Checkbox(_Block):
    pass


class Radio(_Block):
    @staticmethod
    def _positional_value(args):
        return None


class Dropdown(_Block):
    @staticmethod
    def _positional_value(args):
        return None


class Slider(_Block):
    def __init__(self, minimum=0, maximum=100, value=None, **kwargs):
        super().__init__(minimum, maximum, value=value, **kwargs)


def update(**kwargs):
    return dict(kwargs, __type__="update")
