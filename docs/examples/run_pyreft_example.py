"""Run one of pyreft's example scripts, unchanged, with pyvene_dist's patch on.

    python docs/examples/run_pyreft_example.py path/to/pyreft/examples/alpaca/train.py ARGS...
    torchrun --nproc_per_node 2 docs/examples/run_pyreft_example.py path/to/pyreft/examples/alpaca/train.py ARGS...

The script runs as ``__main__`` with its own folder first on the path (loreft/train.py imports
``task_config``, ``dataset`` and ``compute_metrics`` from beside it) and its own arguments.
"""

import os
import runpy
import sys

import pyvene_dist

pyvene_dist.patch()

script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
