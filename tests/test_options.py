"""patch()'s switches: each declared by what it belongs to (the core's ``allow_unsupported``, a fix's in its record),
one parser for every environment variable, arguments first, bad values and unknown names refused by name."""

import inspect

import pytest

import pyvene_dist
from pyvene_dist import fixes
from pyvene_dist._options import ALLOW_UNSUPPORTED, Option, Options, switch
from pyvene_dist._registry import OPTIONS

WORDS = {"1": True, "true": True, "YES": True, "On": True, "0": False, "False": False, "no": False, "OFF": False}
#: Every option of patch(): the core's and each fix's, as declared.
DECLARED = [ALLOW_UNSUPPORTED] + [option for fix in fixes.fixes() for option in fix.options]


@pytest.mark.parametrize("variable", [option.variable for option in DECLARED])
@pytest.mark.parametrize("value, expected", WORDS.items())
def test_every_variable_takes_every_word_in_any_case(variable, value, expected):
    assert switch(variable, not expected, {variable: value}) is expected
    assert switch(variable, expected, {variable: f" {value} "}) is expected


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(default):
    assert switch("PYVENE_DIST_FAST_PATH", default, {}) is default
    assert switch("PYVENE_DIST_FAST_PATH", default, {"PYVENE_DIST_FAST_PATH": ""}) is default


@pytest.mark.parametrize("option", DECLARED, ids=lambda option: option.name)
def test_patch_refuses_another_value_naming_the_variable_the_expected_and_the_found(monkeypatch, option):
    monkeypatch.setenv(option.variable, "maybe")
    with pytest.raises(ValueError) as error:
        pyvene_dist.patch()
    assert str(error.value).startswith(f"{option.variable}='maybe': expected one of 1, true, yes, on (on) or 0, "
                                       "false, no, off (off), in any case, or unset")
    assert not pyvene_dist.is_patched()


@pytest.mark.parametrize("option", DECLARED, ids=lambda option: option.name)
def test_the_environment_is_read_once_at_patch_and_the_argument_wins(monkeypatch, option):
    argument = option.name
    monkeypatch.setenv(option.variable, "no")
    with pyvene_dist.patched():
        assert getattr(OPTIONS.current, argument) is False
        monkeypatch.setenv(option.variable, "yes")  # read at patch(), not at run time
        assert getattr(OPTIONS.current, argument) is False
    with pyvene_dist.patched(**{argument: False}):
        assert getattr(OPTIONS.current, argument) is False
    monkeypatch.setenv(option.variable, "off")
    with pyvene_dist.patched(**{argument: True}):
        assert getattr(OPTIONS.current, argument) is True
    assert OPTIONS.current is None  # unpatched: no options in force


def test_an_argument_that_is_not_a_boolean_is_refused_naming_it_and_its_owner():
    with pytest.raises(TypeError, match=r"^fast_path='0': expected True, False or None \(an option of the fix "
                                        r"'fast_path'\)$"):
        pyvene_dist.patch(fast_path="0")
    with pytest.raises(TypeError, match=r"^cuda_graphs=0: expected True, False or None \(an option of the fix "
                                        r"'orthogonal'\)$"):
        pyvene_dist.patch(cuda_graphs=0)
    with pytest.raises(TypeError, match=r"^allow_unsupported=1: expected True, False or None \(an option of "
                                        r"pyvene_dist\.patch\(\)\)$"):
        pyvene_dist.patch(allow_unsupported=1)
    assert not pyvene_dist.is_patched()


def test_the_fixes_options_are_declared_by_the_fixes_that_read_them_not_by_the_core():
    """``cuda_graphs`` is ``orthogonal``'s, ``fast_path`` is ``fast_path``'s and ``sharded_loading`` is
    ``sharded_loading``'s: their records declare them, and
    ``patch()`` knows them only from there (its signature names the core's ``allow_unsupported`` alone)."""
    owners = {option.name: fix.name for fix in fixes.fixes() for option in fix.options}
    assert owners == {"cuda_graphs": "orthogonal", "fast_path": "fast_path", "sharded_loading": "sharded_loading"}
    keywords = [name for name, parameter in inspect.signature(pyvene_dist.patch).parameters.items()
                if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keywords == ["only", "exclude", "allow_unsupported"]


def test_an_unknown_option_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(TypeError, match=r"^pyvene_dist\.patch\(\) has no option 'cuda_graph'; its options: "
                                        r"allow_unsupported, cuda_graphs, fast_path, sharded_loading$"):
        pyvene_dist.patch(cuda_graph=False)
    assert not pyvene_dist.is_patched()


def test_an_option_two_owners_declare_is_refused_naming_both():
    twice = Option("fast_path", "PYVENE_DIST_FAST_PATH", default=True)
    with pytest.raises(ValueError, match=r"^the option 'fast_path' is declared by both the fix 'a' and the fix 'b'$"):
        Options.resolve([("the fix 'a'", twice), ("the fix 'b'", twice)], {})


def test_options_are_read_only():
    options = Options(fast_path=True)
    with pytest.raises(AttributeError, match=r"Options are read-only \(setting 'fast_path'\)"):
        options.fast_path = False
    assert options.replace(fast_path=False).fast_path is False and options.fast_path is True
    with pytest.raises(TypeError, match=r"Options has no option 'cuda_graph'; known: fast_path"):
        options.replace(cuda_graph=False)


def test_a_record_refuses_options_that_are_not_a_tuple_of_option():
    from pyvene_dist._records import Fix

    graphs = Option("cuda_graphs", "PYVENE_DIST_CUDA_GRAPHS", default=True)
    for wrong in (graphs, ["cuda_graphs"], ("cuda_graphs",)):
        with pytest.raises(TypeError, match=r"^Fix 'tests\.options': options=.*, expected a tuple of "
                                            r"pyvene_dist\._options\.Option$"):
            Fix("tests.options", sites=(), options=wrong)
    assert Fix("tests.options", sites=(), options=(graphs,)).options == (graphs,)
