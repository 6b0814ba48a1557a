"""``pyvene_dist.mechanisms.arguments.bound``: a wrapper's ``args``/``kwargs`` by the original's parameter names."""

import pytest
import wrapt

from pyvene_dist.mechanisms import arguments
from pyvene_dist.mechanisms.arguments import bound


def load(load_directory, model, local_directory=None, include_model=False):
    return load_directory, model, local_directory, include_model


class Trainer:
    def save_model(self, output_dir=None, _internal_call=False):
        return output_dir, _internal_call

    @classmethod
    def build(cls, size, *, name="tiny"):
        return cls, size, name

    @staticmethod
    def load(load_directory, include_model=True):
        return load_directory, include_model


def test_positions_and_keywords_bind_by_name_with_defaults_applied():
    for args, kwargs in [(("folder", "m"), {}), (("folder",), {"model": "m"}), ((), {"model": "m", "load_directory": "folder"})]:
        assert bound(load, args, kwargs).arguments == {
            "load_directory": "folder", "model": "m", "local_directory": None, "include_model": False}


def test_a_bound_method_binds_without_its_instance_and_the_call_is_the_same():
    trainer = Trainer()
    arguments = bound(trainer.save_model, ("out",), {})
    assert arguments.arguments == {"output_dir": "out", "_internal_call": False}
    assert trainer.save_model(*arguments.args, **arguments.kwargs) == ("out", False)
    arguments = bound(Trainer.build, (3,), {})
    assert arguments.arguments == {"size": 3, "name": "tiny"}
    assert Trainer.build(*arguments.args, **arguments.kwargs) == (Trainer, 3, "tiny")
    assert bound(Trainer.load, ("folder",), {}).arguments == {"load_directory": "folder", "include_model": True}


def test_what_a_wrapt_wrapper_receives_binds_against_the_original():
    seen = []

    def wrapper(wrapped, instance, args, kwargs):
        seen.append(bound(wrapped, args, kwargs).arguments)
        return wrapped(*args, **kwargs)

    class Patched(Trainer):
        pass

    wrapt.wrap_function_wrapper(Patched, "save_model", wrapper)
    wrapt.wrap_function_wrapper(Patched, "load", wrapper)
    Patched().save_model(output_dir="out")
    Patched.load("folder", include_model=False)
    assert seen == [{"output_dir": "out", "_internal_call": False},
                    {"load_directory": "folder", "include_model": False}]


def test_a_call_the_original_refuses_is_refused_naming_the_function():
    with pytest.raises(TypeError, match=r"test_arguments\.load\(\): missing a required argument: 'model'"):
        bound(load, ("folder",), {})
    with pytest.raises(TypeError, match=r"test_arguments\.Trainer\.save_model\(\): got an unexpected keyword "
                                        r"argument 'output'; its signature is \(output_dir=None"):
        bound(Trainer().save_model, (), {"output": "out"})


def test_signatures_are_read_once_per_function_not_per_instance():
    arguments._signature.cache_clear()
    for _ in range(3):
        bound(Trainer().save_model, (), {})
    assert arguments._signature.cache_info().currsize == 1
