"""The ``--dtype`` spelling shared by ``pyvene-dist`` and the example scripts (docs/examples/train_reft.py and
serve_reft.py): torch names. The short names (``--dtype bf16``) still work, with a one-line note on stderr
naming the torch one (``deprecated``, which ``pyvene-dist``'s old ``--layers '2;8'`` uses too).

    parser.add_argument("--dtype", type=functools.partial(flags.dtype_name, program="serve_reft.py"),
                        choices=flags.DTYPES)

``model_folder_problem`` is the scripts' one check of a ``--model`` folder, before anything is loaded from it.
"""

from __future__ import annotations

import os
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


#: Files of which a tokenizer saved with ``save_pretrained`` holds at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def model_folder_problem(path: str) -> str | None:
    """Why ``path`` is no model folder the example scripts load (the model and its tokenizer, as ``save_pretrained``
    writes them), in words that follow the flag's name; None where it is one, or a hub name. A file was read as a hub
    name (``Repo id must be in the form 'repo_name'``, or a ``TypeError``), and a folder without tokenizer files
    failed with advice to install sentencepiece."""
    if os.path.isfile(path):
        return (f"{path} is a file; expected the model's folder (its config.json, weights and tokenizer, as "
                "save_pretrained writes them)")
    if not os.path.isdir(path):
        if os.path.isabs(path) or path.startswith(".") or path.count("/") > 1:  # a hub name is NAME or OWNER/NAME
            return f"{path} is not there; expected the model's folder, or a hub name such as OWNER/NAME"
        return None
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"{path} holds no config.json; expected the model's folder, as save_pretrained writes it"
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return (f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:2])}, ...); the scripts load it from "
                f"the model's folder: save it there too (tokenizer.save_pretrained('{path}'))")
    return None
