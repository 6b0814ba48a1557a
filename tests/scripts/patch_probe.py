"""Drive pyvene_dist's patch layer through a sequence of steps in a fresh interpreter.

    python patch_probe.py import patch unpatch check-restored

Steps: ``import`` (pyvene, pyreft, transformers.trainer), ``import-pyvene``, ``import-pyreft``,
``capture`` (remember every site's current object), ``patch``, ``unpatch``, ``check-wrapped`` (every
imported site is wrapped exactly once around the captured object), ``check-restored`` (every site is
the very object captured, or for sites imported after patching, the plain function defined in its
module), ``check-lazy`` (pyreft is not imported yet), ``check-behaviour-patched`` /
``check-behaviour-original`` (named_parameters of a tiny ReFT model yields all / only trainable ones).
Exits non-zero with the failed assertion.
"""

import functools
import importlib
import sys
import types

import wrapt

captured = {}
MISSING = object()


def sites():
    from pyvene_dist.patches import concerns

    for concern in concerns():
        for site in concern.SITES:
            module_name, path = site.split(":")
            owner_path, attribute = path.rsplit(".", 1) if "." in path else ("", path)
            module = sys.modules.get(module_name)
            if module is None:
                continue
            owner = module
            for part in filter(None, owner_path.split(".")):
                owner = getattr(owner, part)
            yield site, owner, attribute


def check_wrapped():
    seen = 0
    for site, owner, attribute in sites():
        current = vars(owner).get(attribute)
        if site in added_sites():  # an attribute pyvene_dist adds rather than wraps
            assert captured.get(site, MISSING) is MISSING, f"{site} existed before patching"
            assert current is not None, f"{site} was not added"
            seen += 1
            continue
        assert isinstance(current, wrapt.FunctionWrapper), f"{site} is not wrapped: {current!r}"
        assert not isinstance(current.__wrapped__, wrapt.ObjectProxy), f"{site} is wrapped twice"
        if site in captured:
            assert current.__wrapped__ is captured[site], f"{site} wraps something other than the original"
        seen += 1
    assert seen, "no site checked"
    return seen


def added_sites():
    from pyvene_dist._registry import _MISSING, REGISTRY

    added = set()
    for record in REGISTRY.sites:
        if record.original is _MISSING:
            module = record.owner.__module__ if isinstance(record.owner, type) else record.owner.__name__
            qualname = f"{record.owner.__qualname__}." if isinstance(record.owner, type) else ""
            added.add(f"{module}:{qualname}{record.attribute}")
    return added


def check_restored():
    for site, owner, attribute in sites():
        current = vars(owner).get(attribute, MISSING)
        if captured.get(site) is MISSING or (site not in captured and current is MISSING):
            assert current is MISSING, f"{site} was added by patching and is still there"
            continue
        assert not isinstance(current, wrapt.ObjectProxy), f"{site} is still wrapped"
        if site in captured:
            assert current is captured[site], f"{site} is not the object found before patching"
        else:
            # Imported after patching: the plain function (or C builtin, as torch's), the same object
            # its defining module holds.
            assert isinstance(current, (types.FunctionType, types.BuiltinFunctionType)), f"{site} is {current!r}"
            home = sys.modules[current.__module__]
            defined = functools.reduce(getattr, current.__qualname__.split("."), home)
            assert defined is current, f"{site} is not the function {current.__module__} defines"


def named_parameter_count():
    from pyvene_dist.testing.models import reft_model, tiny_llama

    model = reft_model(tiny_llama())
    return len(list(model.named_parameters())), len(model.get_trainable_parameters())


def run(step):
    if step == "import":
        for name in ("pyvene", "pyreft", "transformers.trainer"):
            importlib.import_module(name)
    elif step == "import-pyvene":
        importlib.import_module("pyvene")
    elif step == "import-pyreft":
        importlib.import_module("pyreft")
        importlib.import_module("transformers.trainer")
    elif step == "capture":
        captured.update({site: vars(owner).get(attribute, MISSING) for site, owner, attribute in sites()})
    elif step == "patch":
        import pyvene_dist

        pyvene_dist.patch()
        assert pyvene_dist.is_patched()
    elif step == "unpatch":
        import pyvene_dist

        pyvene_dist.unpatch()
        assert not pyvene_dist.is_patched()
    elif step == "check-wrapped":
        print("wrapped", check_wrapped())
    elif step == "check-restored":
        check_restored()
    elif step == "check-lazy":
        assert "pyreft" not in sys.modules, "patch() imported pyreft"
    elif step == "check-behaviour-patched":
        every, trainable = named_parameter_count()
        assert every > trainable, (every, trainable)
    elif step == "check-behaviour-original":
        every, trainable = named_parameter_count()
        assert every == trainable, (every, trainable)
    else:
        raise SystemExit(f"unknown step {step!r}")


if __name__ == "__main__":
    for step in sys.argv[1:]:
        run(step)
    print("ok")
