"""A ReFT to evaluate: its folder's ``train_settings.json`` read with the arguments given over it, and the folder
loaded onto a base model as ``docs/examples/serve_reft.py`` loads it (``pyvene_dist.reft_folder`` reads the folder)."""

from __future__ import annotations

import contextlib
import dataclasses
import os

from .. import is_patched, patched
from ..flags import DTYPES, dtype_name
from ..positions import parse_positions
from ..reft_folder import SETTINGS, load_folder, location_count_problem, saved_config, saved_settings


@dataclasses.dataclass(frozen=True)
class ReftSettings:
    """What evaluating a ReFT needs besides its weights: the base model's folder, pyreft's ``positions`` and
    ``share_weights`` of training, and the dtype the base is loaded in (``None``: the checkpoint's own)."""

    pretrained: str | None
    positions: str
    share_weights: bool
    dtype: str | None


def reft_settings(folder: str | os.PathLike, *, pretrained=None, positions=None, share_weights=None,
                  dtype=None) -> ReftSettings:
    """The arguments given, else what ``train_settings.json`` in ``folder`` holds (docs/examples/train_reft.py
    writes it); ``positions`` and the base model must come from one or the other."""
    folder = os.fspath(folder)
    saved_config(folder, "reft")  # refuses a folder ReftModel.save did not write, naming it
    saved = saved_settings(folder)
    pretrained = pretrained if pretrained is not None else saved.get("model")
    positions = positions if positions is not None else saved.get("positions")
    if positions is None:
        raise ValueError(f"positions: reft={folder} has no {SETTINGS}; pass the positions of training, e.g. "
                         "positions=f1+l1 (and share_weights=True if training shared them)")
    if pretrained is None:
        raise ValueError(f"pretrained: reft={folder} has no {SETTINGS} naming the base model; pass pretrained= "
                         "with the base model's folder")
    if isinstance(pretrained, str) and not os.path.isdir(pretrained) and (
            os.path.isabs(pretrained) or pretrained.startswith(".")):
        source = "pretrained" if saved.get("model") != pretrained else f"{os.path.join(folder, SETTINGS)}'s model"
        raise ValueError(f"{source}: expected the base model's folder, found {pretrained!r}, which is not there "
                         "(moved or deleted?); pass pretrained= with the folder as it is now")
    return settings_of(pretrained, positions, saved.get("share_weights", False) if share_weights is None
                       else share_weights, dtype if dtype is not None else saved.get("dtype"))


def settings_of(pretrained, positions, share_weights, dtype) -> ReftSettings:
    """Checked settings: pyreft's positions form (``f1+l1``, ``l1``), a bool (or lm-eval's ``True``/``False``
    text) for ``share_weights``, a torch dtype name."""
    parse_positions(positions)
    if isinstance(share_weights, str) and share_weights.lower() in ("true", "false"):
        share_weights = share_weights.lower() == "true"
    if not isinstance(share_weights, bool):
        raise ValueError(f"share_weights: expected True or False, found {share_weights!r}")
    if dtype is not None and dtype != "auto":
        name = dtype_name(str(dtype).removeprefix("torch."), program="pyvene-dist eval")
        if name not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)} or auto, found {dtype!r}")
        dtype = name
    return ReftSettings(pretrained, positions, share_weights, dtype)


def load_reft(folder: str | os.PathLike, base, settings: ReftSettings):
    """``pyreft.ReftModel.load(folder, base)`` under the patch (each weight in the dtype it was saved in), in
    eval mode, checked against ``settings``' positions."""
    folder = os.fspath(folder)
    config = saved_config(folder, "reft")
    with contextlib.nullcontext() if is_patched() else patched():
        try:
            reft_model = load_folder(folder, base, config, "reft")
        except RuntimeError as error:
            if "size mismatch" not in str(error):
                raise
            mismatch = next(line.strip() for line in str(error).splitlines() if "size mismatch" in line)
            raise ValueError(f"reft: the interventions in {folder} were trained on a base model of another size "
                             f"than pretrained (hidden_size {base.config.hidden_size}): {mismatch}") from None
    check_locations(reft_model, settings, folder)
    reft_model.eval()
    return reft_model


def check_locations(reft_model, settings: ReftSettings, source) -> None:
    first, last = parse_positions(settings.positions)
    problem = location_count_problem(first, last, settings.share_weights, len(reft_model.interventions))
    if problem is not None:
        raise ValueError(problem.format(folder=source, positions=settings.positions,
                                        share_weights=settings.share_weights))
