"""Stand-in for ``modules.paths``: the tests point ``models_path`` at a temporary folder."""
import os
import tempfile

models_path = os.path.join(tempfile.gettempdir(), "sdslim-standin-models")
