"""The first module the gloo fork server imports: it takes the caller's ``sys.path`` before anything else.

Python's fork server (3.11, 3.12) is started as ``python -c ...`` and is handed the caller's ``sys.path``,
but ignores it while it imports its preload list: it imports from the working directory, ``PYTHONPATH``
and site-packages instead. A caller whose megatron comes from elsewhere (the runner puts a Megatron-LM
checkout first on ``sys.path``) would get every rank forked with the installed megatron-core already
imported, and the check would test another megatron than the caller's. :func:`.spawn.spawn` passes its
``sys.path`` in ``VSHAPE_FORKSERVER_SYS_PATH`` while the server starts; only the server imports this module.
"""

import json
import os
import sys

from .spawn import FORKSERVER_SYS_PATH

if os.environ.get(FORKSERVER_SYS_PATH):
    sys.path[:] = json.loads(os.environ[FORKSERVER_SYS_PATH])
