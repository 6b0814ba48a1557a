"""docs/examples/train_reft.py run once for each argument list, one after the other in this one process, each as
``python docs/examples/train_reft.py ARGS`` runs it (as ``__main__``, its folder first on ``sys.path``): the process
imports torch, transformers and pyvene once for all the runs. Without a launcher only: train_reft.py leaves the
process group at its end.

    python train_reft_each.py ARGS [--then ARGS]...
"""

import runpy
import sys
from pathlib import Path

TRAIN = Path(__file__).parents[2] / "docs" / "examples" / "train_reft.py"

runs = [[]]
for argument in sys.argv[1:]:
    if argument == "--then":
        runs.append([])
    else:
        runs[-1].append(argument)
sys.path.insert(0, str(TRAIN.parent))
for argv in runs:
    sys.argv = [str(TRAIN), *argv]
    runpy.run_path(str(TRAIN), run_name="__main__")
