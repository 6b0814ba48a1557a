"""What the preloaded server (``_preloaded``) imports before it forks ranks. Its only user is that server.

pyvene prints a notice to standard output as it is imported ("nnsight is not detected"); the server shares
its parent's standard output, whose readers (``pyvene-dist check --json``) expect their own text there, so
what the imports print goes to standard error.
"""

import contextlib
import sys

with contextlib.redirect_stdout(sys.stderr):
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers  # noqa: F401
    import pyvene  # noqa: F401

    from . import launch  # noqa: F401
