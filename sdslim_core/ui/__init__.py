"""``sdslim ui``: a local web app (gradio, optional: ``pip install sdslim[ui]``) over the CLI's own code paths.

``paths`` (the folders the UI may use), ``actions`` (what each tab does, gradio-free), ``app`` (the gradio
Blocks), ``cli`` (the command).
"""
