"""What the preloaded server (``_preloaded``) imports before it forks ranks. Its only user is that server.

pyvene prints a notice to standard output as it is imported ("nnsight is not detected"); the server shares
its parent's standard output, whose readers (``pyvene-dist check --json``) expect their own text there, so
what the imports print goes to standard error.

The objects those imports made (about 520,000) are then moved to the collector's permanent generation
(``gc.freeze``, as Python's documentation advises before forking): they live as long as the process, and a
full collection in a rank no longer walks them: HF Trainer collects at every ``train()`` (accelerate's
``free_memory``) and ZeRO-3 once more as it partitions, 0.30 s each on a 2-core machine with those objects
walked, 0.04 s without.
"""

import contextlib
import gc
import sys

with contextlib.redirect_stdout(sys.stderr):
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers  # noqa: F401
    import pyvene  # noqa: F401

    from . import launch  # noqa: F401

gc.freeze()
