"""Drive pyvene_dist's patch layer through a sequence of steps in a fresh interpreter.

    python patch_probe.py import patch unpatch check-restored

Steps: ``import`` (pyvene, pyreft, transformers.trainer), ``import-pyvene``, ``import-pyreft``,
``capture`` (remember every site's current object), ``patch``, ``unpatch``, ``check-wrapped`` (every
imported site is wrapped exactly once around the captured object; prints each), ``check-restored`` (every site is
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

#: Modules of the optional extras whose sites are patched when they are imported (``_records.IMPORTED_LATER``).
OPTIONAL_LATER = ("accelerate.utils.fsdp_utils", "deepspeed.runtime.engine")

captured = {}
MISSING = object()


def sites():
    """(path, owner, attribute, kind) of every site of every fix ``patch()`` applies, whose module is imported."""
    from pyvene_dist.fixes import select

    for fix in select():
        for site in fix.places:
            module = sys.modules.get(site.module)
            if module is not None:
                yield site.path, site.owner(module), site.attribute, site.kind


def check_wrapped():
    from pyvene_dist._registry import is_entry

    seen = []
    for site, owner, attribute, kind in sites():
        current = vars(owner).get(attribute)
        if kind == "entry":  # a plain function in front of what was there (another fix's wrap, or the original)
            assert is_entry(current) and isinstance(current, types.FunctionType), f"{site} is no entry: {current!r}"
            inner = current.__wrapped__
            while is_entry(inner):  # the entries of several fixes stack, each once (the later outside)
                assert inner is not current and inner.__pyvene_dist_made_by__ is not current.__pyvene_dist_made_by__, \
                    f"{site} has one fix's entry twice"
                inner = inner.__wrapped__
            original = inner.__wrapped__ if isinstance(inner, wrapt.FunctionWrapper) else inner
            if site in captured:
                assert original is captured[site], f"{site} stands in front of something other than the original"
            seen.append(site)
            continue
        while is_entry(current):  # a wrap under an entry
            current = current.__wrapped__
        if kind == "add":  # an attribute pyvene_dist adds rather than wraps
            assert captured.get(site, MISSING) is MISSING, f"{site} existed before patching"
            assert current is not None, f"{site} was not added"
            seen.append(site)
            continue
        assert isinstance(current, wrapt.FunctionWrapper), f"{site} is not wrapped: {current!r}"
        assert not isinstance(current.__wrapped__, wrapt.ObjectProxy), f"{site} is wrapped twice"
        if site in captured:
            assert current.__wrapped__ is captured[site], f"{site} wraps something other than the original"
        seen.append(site)
    assert seen, "no site checked"
    return seen


def check_restored():
    seen = []
    for site, owner, attribute, _ in sites():
        seen.append(site)
        current = vars(owner).get(attribute, MISSING)
        if captured.get(site) is MISSING or (site not in captured and current is MISSING):
            assert current is MISSING, f"{site} was added by patching and is still there"
            continue
        assert not isinstance(current, wrapt.ObjectProxy), f"{site} is still wrapped"
        if site in captured:
            assert current is captured[site], f"{site} is not the object found before patching"
        else:
            # Imported after patching: the plain function (or C builtin, as torch's; a static method's
            # function), the same object its defining module holds.
            function = current.__func__ if isinstance(current, staticmethod) else current
            assert isinstance(function, (types.FunctionType, types.BuiltinFunctionType)), f"{site} is {current!r}"
            home = sys.modules[function.__module__]
            defined = functools.reduce(getattr, function.__qualname__.split("."), home)
            assert defined is function, f"{site} is not the function {function.__module__} defines"
    return seen


def named_parameter_count():
    from pyvene_dist.testing.models import reft_model, tiny_llama

    model = reft_model(tiny_llama())
    return len(list(model.named_parameters())), len(model.get_trainable_parameters())


def run(step):
    if step == "import":
        for name in ("pyvene", "pyreft", "transformers.trainer", *OPTIONAL_LATER):
            importlib.import_module(name)
    elif step == "import-pyvene":
        importlib.import_module("pyvene")
    elif step == "import-pyreft":
        importlib.import_module("pyreft")
        importlib.import_module("transformers.trainer")
        for name in OPTIONAL_LATER:
            importlib.import_module(name)
    elif step == "capture":
        captured.update({site: vars(owner).get(attribute, MISSING) for site, owner, attribute, _ in sites()})
    elif step == "patch":
        import pyvene_dist

        pyvene_dist.patch()
        assert pyvene_dist.is_patched()
    elif step == "unpatch":
        import pyvene_dist

        pyvene_dist.unpatch()
        assert not pyvene_dist.is_patched()
    elif step == "check-wrapped":
        print(*(f"wrapped {site}" for site in check_wrapped()), sep="\n")
    elif step == "check-restored":
        print(*(f"restored {site}" for site in check_restored()), sep="\n")
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
