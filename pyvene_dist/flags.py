"""The ``--dtype`` spelling shared by ``pyvene-dist`` and the example scripts (docs/examples/train_reft.py and
serve_reft.py): torch names. The short names (``--dtype bf16``) still work, with a one-line note on stderr
naming the torch one (``deprecated``, which ``pyvene-dist``'s old ``--layers '2;8'`` uses too).

    parser.add_argument("--dtype", type=functools.partial(flags.dtype_name, program="serve_reft.py"),
                        choices=flags.DTYPES)
"""

from __future__ import annotations

import sys
from types import MappingProxyType

#: The torch names of the dtypes the commands and scripts take.
DTYPES = ("float32", "bfloat16", "float16")
#: The short names plan took before, and what each stands for.
OLD_DTYPES = MappingProxyType({"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"})


def deprecated(old: str, new: str, program: str = "pyvene-dist") -> None:
    print(f"{program}: {old} is deprecated and will stop working; write {new}", file=sys.stderr)


def dtype_name(text: str, program: str = "pyvene-dist") -> str:
    """The torch name for ``text``: an old short name becomes its torch name, with a note; the rest is
    returned as given, for the caller's own check (argparse's ``choices``)."""
    if text in OLD_DTYPES:
        deprecated(f"--dtype {text}", f"--dtype {OLD_DTYPES[text]}", program)
        return OLD_DTYPES[text]
    return text
