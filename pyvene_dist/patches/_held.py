"""The records of ``hooks`` and ``checkpointing``, kept here while another branch owns those two modules.

After that branch is merged, each record moves to the top of its module in place of ``SITES`` and
``patch()`` (as every other fix declares its ``FIX``), and this file goes.
"""

from __future__ import annotations

from .._registry import Fix, Site

_BASE = "pyvene.models.intervenable_base"

RECORDS = (
    Fix(
        "pyvene_dist.patches.hooks",
        sites=(
            Site(f"{_BASE}:IntervenableModel._intervention_getter", "_wrap_hook_factory"),
            Site(f"{_BASE}:IntervenableModel._intervention_setter", "_wrap_setter_factory"),
            Site(f"{_BASE}:IntervenableModel._remove_forward_hooks", "_wrap_remove_forward_hooks", kind="replace",
                 fingerprint="f76d928fd9d68878"),
        ),
        upstream=("pyvene",),
        checked={"pyvene": "==0.1.8"},
    ),
    Fix(
        "pyvene_dist.patches.checkpointing",
        sites=(
            Site(f"{_BASE}:IntervenableModel.forward", "_wrap_forward"),
            Site(f"{_BASE}:IntervenableModel._output_validation", "_wrap_output_validation"),
        ),
        requires=("hooks",),  # its kept setters are the hooks fix's record of pyvene's handles
        upstream=("pyvene",),
        checked={"pyvene": "==0.1.8"},
    ),
)
