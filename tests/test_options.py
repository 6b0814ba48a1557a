"""patch()'s switches: one parser for every environment variable, arguments first, bad values refused by name."""

import pytest

import pyvene_dist
from pyvene_dist._options import VARIABLES, Options, switch
from pyvene_dist._registry import REGISTRY

WORDS = {"1": True, "true": True, "YES": True, "On": True, "0": False, "False": False, "no": False, "OFF": False}


@pytest.mark.parametrize("variable", [variable for variable, _ in VARIABLES.values()])
@pytest.mark.parametrize("value, expected", WORDS.items())
def test_every_variable_takes_every_word_in_any_case(variable, value, expected):
    assert switch(variable, not expected, {variable: value}) is expected
    assert switch(variable, expected, {variable: f" {value} "}) is expected


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(default):
    assert switch("PYVENE_DIST_FAST_PATH", default, {}) is default
    assert switch("PYVENE_DIST_FAST_PATH", default, {"PYVENE_DIST_FAST_PATH": ""}) is default


@pytest.mark.parametrize("argument", sorted(VARIABLES))
def test_patch_refuses_another_value_naming_the_variable_the_expected_and_the_found(monkeypatch, argument):
    variable = VARIABLES[argument][0]
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(ValueError) as error:
        pyvene_dist.patch()
    assert str(error.value).startswith(f"{variable}='maybe': expected one of 1, true, yes, on (on) or 0, false, no, "
                                       "off (off), in any case, or unset")
    assert not pyvene_dist.is_patched()


@pytest.mark.parametrize("argument", sorted(VARIABLES))
def test_the_environment_is_read_once_at_patch_and_the_argument_wins(monkeypatch, argument):
    variable = VARIABLES[argument][0]
    monkeypatch.setenv(variable, "no")
    with pyvene_dist.patched():
        assert getattr(REGISTRY.options, argument) is False
        monkeypatch.setenv(variable, "yes")  # read at patch(), not at run time
        assert getattr(REGISTRY.options, argument) is False
    with pyvene_dist.patched(**{argument: False}):
        assert getattr(REGISTRY.options, argument) is False
    monkeypatch.setenv(variable, "off")
    with pyvene_dist.patched(**{argument: True}):
        assert getattr(REGISTRY.options, argument) is True


def test_an_argument_that_is_not_a_boolean_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"fast_path='0': expected True, False or None"):
        Options.resolve(fast_path="0")
    with pytest.raises(TypeError, match=r"allow_unsupported=1: expected True, False or None"):
        pyvene_dist.patch(allow_unsupported=1)
