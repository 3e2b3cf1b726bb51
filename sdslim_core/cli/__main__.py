"""``python -m sdslim_core.cli``: the ``sdslim`` command."""
import sys

from . import main

sys.exit(main())
