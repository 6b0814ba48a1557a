"""Helpers shared by the tests (importable from spawned ranks too: this folder is on sys.path)."""

import ctypes
import ctypes.util
import os
from pathlib import Path

#: Set to a folder of patched pyvene/pyreft copies (scripts/upstream_patches.py) to test those instead.
UPSTREAM_ENV = "PYVENE_DIST_TEST_UPSTREAM"


def patch():
    """``pyvene_dist.patch()``, minus the fixes named in PYVENE_DIST_TEST_WITHOUT (or all of them), and
    those built on them.

    PYVENE_DIST_TEST_WITHOUT=weight_decay,hooks pytest tests/   shows which tests fail without those fixes.
    PYVENE_DIST_TEST_UPSTREAM=<folder>: see ``patch_upstream``.
    """
    import pyvene_dist
    from pyvene_dist import fixes

    upstream = os.environ.get(UPSTREAM_ENV)
    if upstream:
        return patch_upstream(Path(upstream))
    without = set(filter(None, os.environ.get("PYVENE_DIST_TEST_WITHOUT", "").split(",")))
    if "all" in without:
        return
    without |= {new for old in without & fixes.RENAMED.keys() for new in fixes.RENAMED[old]}  # an old name
    without |= {new for group in without & fixes.groups().keys() for new in fixes.groups()[group]}  # a group
    known = fixes.by_name()
    unknown = without - known.keys() - fixes.RENAMED.keys() - fixes.groups().keys()
    if unknown:  # a misspelt name would exclude nothing, and every test would pass "without" it
        raise ValueError(f"PYVENE_DIST_TEST_WITHOUT names {sorted(unknown)}, which are no fixes; known: {sorted(known)}")
    pyvene_dist.patch(exclude=[name for name, fix in known.items() if fixes.required_by([fix], known) & without])


def patch_upstream(folder: Path) -> None:
    """The tests against pyvene and pyreft with the upstream diffs applied, in ``folder``.

    Those copies must be what is imported, and their ``FIXES`` must name every fix with a diff
    (``patch()`` would skip those). Only the runtime-only fixes are applied (torch's DataParallel,
    DDP, FSDP and tensor-parallel setup, torch's orthogonal parametrization), and of pyvene they wrap
    nothing but ``BaseModel.get_device`` (DataParallel replicas), ``BaseModel.__init__`` (where
    ``fixes.orthogonal`` finds pyvene's rotations), ``BaseModel.set_device`` (``fixes.sharded_loading``
    keeps the interventions off a base still on the meta device) and the two interventions-forward waits (tensor
    parallel). Concerns that are neither (performance fast paths) are left off: parity needs none.
    """
    import pyreft
    import pyvene

    import pyvene_dist
    from pyvene_dist import fixes
    from pyvene_dist._registry import UNDO_LOG

    for module in (pyvene, pyreft):
        if not Path(module.__file__).resolve().is_relative_to(folder.resolve()):
            raise RuntimeError(f"{UPSTREAM_ENV}={folder}, but {module.__name__} is imported from {module.__file__}")
    not_carried = sorted({fix.name for fix in fixes.fixes() if fix.upstream} - fixes.upstreamed())
    if not_carried:
        raise RuntimeError(f"the copies in {folder} do not report carrying {not_carried} in their FIXES")
    pyvene_dist.patch(only=[fix.name for fix in fixes.fixes() if not fix.upstream])
    touched = [site.name for site in UNDO_LOG.sites if site.name.startswith(("pyvene", "pyreft"))]
    tensor_parallel = [f"pyvene.models.intervenable_base.IntervenableModel.{name}" for name in (
        "_wait_for_forward_with_parallel_intervention", "_wait_for_forward_with_serial_intervention")]
    base_model = [f"pyvene.models.intervenable_base.BaseModel.{name}" for name in ("get_device", "__init__")]
    fast_path = [f"pyvene.models.intervenable_base.IntervenableModel.{name}" for name in ("forward", "generate")]
    orthogonal = ["pyvene.models.intervenable_base.IntervenableModel.load"]  # its entry adopts the loaded rotations
    sharded_loading = ["pyvene.models.intervenable_base.BaseModel.set_device"]  # interventions kept off a meta base
    if sorted(touched) != sorted([*base_model, *tensor_parallel, *fast_path, *orthogonal, *sharded_loading]):
        raise RuntimeError(f"runtime-only fixes wrapped {touched} of pyvene and pyreft")


#: Where scripts/fetch_libaio.sh unpacks libaio (DeepSpeed's NVMe offload builds its async_io op against it).
LIBAIO = Path(__file__).resolve().parents[1] / ".libaio"


def libaio_missing() -> str | None:
    """Why DeepSpeed's async_io op cannot build here, or None: the header and library of libaio,
    from .libaio (``bash scripts/fetch_libaio.sh``) or the system (``apt install libaio-dev``)."""
    if list(LIBAIO.glob("usr/lib/*/libaio.so.1")) and (LIBAIO / "usr/include/libaio.h").exists():
        return None
    if ctypes.util.find_library("aio") and Path("/usr/include/libaio.h").exists():
        return None
    return "NVMe offload needs libaio: bash scripts/fetch_libaio.sh (or apt install libaio-dev)"


def use_libaio() -> None:
    """Let this process build and load DeepSpeed's async_io op against .libaio, when that is where libaio is."""
    found = sorted(LIBAIO.glob("usr/lib/*/libaio.so.1"))
    if not found:
        return  # the system's, if any
    for variable, folder in (("CPATH", LIBAIO / "usr/include"), ("LIBRARY_PATH", found[0].parent)):
        os.environ[variable] = os.pathsep.join(filter(None, [str(folder), os.environ.get(variable)]))
    # The loader reads LD_LIBRARY_PATH at start only: load libaio now, and the op's library finds it loaded.
    ctypes.CDLL(str(found[0]), mode=ctypes.RTLD_GLOBAL)


def hook_counts(model) -> list[tuple[int, int]]:
    """(forward hooks, pre-hooks) of each module of ``model``'s base model, less the hooks of its plan
    (``fixes.fast_path``): registered once, one per intervention, idle outside the plan's calls."""
    from pyvene_dist.fixes.fast_path import plan_of

    plan = plan_of(model)
    planned = {handle.id for handle in plan.handles} if plan is not None else set()
    assert len(planned) in (0, len(model.interventions)), f"{len(planned)} plan hooks for {len(model.interventions)}"
    return [(len(m._forward_hooks.keys() - planned), len(m._forward_pre_hooks)) for m in model.model.modules()]


def backward_names(grad_fn) -> set[str]:
    """The class names of every autograd node behind ``grad_fn``."""
    names, pending = set(), [grad_fn]
    while pending:
        node = pending.pop()
        if node is not None:
            names.add(type(node).__name__)
            pending.extend(next_node for next_node, _ in node.next_functions)
    return names


def train_step(model, optimizer, case):
    """One optimizer step of a pyvene model on ``case``'s first batch (a ``ParityCase``), its output returned."""
    batch = case.batches()[0]
    _, out = model({"input_ids": batch["input_ids"]},
                   unit_locations={"sources->base": (None, batch["locations"].tolist())}, labels=batch["labels"])
    out.loss.backward()
    optimizer.step()
    return out
