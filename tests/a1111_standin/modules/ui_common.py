"""Stand-in for ``modules.ui_common``."""
import gradio as gr


def create_refresh_button(refresh_component, refresh_method, refreshed_args, elem_id):
    """A button that calls ``refresh_method()`` and applies ``refreshed_args`` (dict or callable) to the component."""
    button = gr.Button(value="\U0001f504", elem_id=elem_id)

    def refresh():
        refresh_method()
        args = refreshed_args() if callable(refreshed_args) else refreshed_args
        for k, v in args.items():
            setattr(refresh_component, k, v)
        return gr.update(**args)
    button.click(fn=refresh, inputs=[], outputs=[refresh_component])
    return button
