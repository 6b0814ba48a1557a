"""Build location indices on the device of the tensor they index, without waiting for that device.

``IntervenableModel`` passes ``device=self.get_device()``, the device of the model's *first*
parameter, to ``gather_neurons`` and ``scatter_neurons``, which build their index tensors there. On a
layer that lives elsewhere (a ``device_map`` split, a ``nn.DataParallel`` replica) that fails with
``RuntimeError: Expected all tensors to be on the same device, but got index is on cuda:0, different
from other tensors on cuda:1``.

Even on one GPU every call costs two host-device synchronisations: ``torch.tensor(list, device=cuda)``
copies from pageable host memory (the host waits for the GPU to drain its queue first), and
``scatter_neurons`` indexes the GPU tensor with a batch index built on the host. With four
interventions that is eight stalls per forward, each one exposing all the Python that follows it.

The fix keeps pyvene's arithmetic (the same ``torch.gather`` and in-place index writes, so outputs are
bit-identical) but takes the indices as they come: a tensor is moved to the indexed tensor's device
(nothing happens when it is already there: pyreft's collated ``intervention_locations``, or the tensors
``fixes.locations`` builds once per forward), a list is turned into one, and the batch index is made
on the device. ``device`` is ignored: the indexed tensor's device is the only right one.

``intervenable_base`` star-imports both names from ``modeling_utils``, so both modules are wrapped.
"""

from __future__ import annotations

import inspect

import torch
from pyvene.models import intervenable_base, modeling_utils
from pyvene.models.modeling_utils import (bhsd_to_bs_hd, bs_hd_to_bhsd, output_to_subcomponent, split_three,
                                         type_to_module_mapping)

from .._records import Fix, Site
from ..mechanisms.indices import as_index



def _check_signatures(options) -> None:
    for module in (modeling_utils, intervenable_base):
        for name, arguments in (("gather_neurons", _gather_arguments), ("scatter_neurons", _scatter_arguments)):
            _check_signature(getattr(module, name), arguments)


def _wrap_gather_neurons(wrapped, instance, args, kwargs):
    return gather_neurons(*_gather_arguments(*args, **kwargs))


def _wrap_scatter_neurons(wrapped, instance, args, kwargs):
    return scatter_neurons(*_scatter_arguments(*args, **kwargs))


# pyvene's signatures, as Python binds them: the arguments without ``device``. They run in every hook
# of every forward, where ``inspect.Signature.bind`` cost more than the index building; ``patch()``
# checks them against the installed pyvene.
def _gather_arguments(tensor_input, unit, unit_locations_as_list, device=None):
    return tensor_input, unit, unit_locations_as_list


def _scatter_arguments(tensor_input, replacing_tensor_input, component, unit, unit_locations_as_list, model_type,
                       model_config, use_fast, device=None):
    return tensor_input, replacing_tensor_input, component, unit, unit_locations_as_list, model_type, model_config, \
        use_fast


def _check_signature(function, arguments) -> None:
    found, expected = inspect.signature(function), inspect.signature(arguments)
    if found != expected:
        raise TypeError(
            f"{function.__module__}.{function.__qualname__}{found} is not the signature "
            f"pyvene_dist was written for, {function.__name__}{expected}: the installed pyvene differs"
        )


def gather_neurons(tensor_input, unit, unit_locations_as_list):
    """pyvene 0.1.8's ``gather_neurons``, its indices on ``tensor_input``'s device."""
    if unit in {"t"}:
        return tensor_input
    device = tensor_input.device
    if "." in unit:
        head_unit_locations = as_index(unit_locations_as_list[0], device)
        pos_unit_locations = as_index(unit_locations_as_list[1], device)
        head_tensor_output = torch.gather(
            tensor_input,
            1,
            head_unit_locations.reshape(*head_unit_locations.shape, *(1,) * (tensor_input.dim() - 2)).expand(
                -1, -1, *tensor_input.shape[2:]
            ),
        )  # b, h, s, d
        d = head_tensor_output.shape[1]
        pos_tensor_input = bhsd_to_bs_hd(head_tensor_output)
        pos_tensor_output = torch.gather(
            pos_tensor_input,
            1,
            pos_unit_locations.reshape(*pos_unit_locations.shape, *(1,) * (pos_tensor_input.dim() - 2)).expand(
                -1, -1, *pos_tensor_input.shape[2:]
            ),
        )  # b, num_unit (pos), num_unit (h)*d
        return bs_hd_to_bhsd(pos_tensor_output, d)  # b, num_unit (h), num_unit (pos), d
    unit_locations = as_index(unit_locations_as_list, device)
    return torch.gather(
        tensor_input,
        1,
        unit_locations.reshape(*unit_locations.shape, *(1,) * (tensor_input.dim() - 2)).expand(
            -1, -1, *tensor_input.shape[2:]
        ),
    )


def scatter_neurons(
    tensor_input, replacing_tensor_input, component, unit, unit_locations_as_list, model_type, model_config, use_fast
):
    """pyvene 0.1.8's ``scatter_neurons``, its indices (the batch index too) on ``tensor_input``'s device."""
    device = tensor_input.device
    if "." in unit:
        unit_locations = (as_index(unit_locations_as_list[0], device), as_index(unit_locations_as_list[1], device))
    else:
        unit_locations = as_index(unit_locations_as_list, device)

    # if the tensor is split (e.g. a fused QKV output), the slice of the last dimension to write
    meta_component = output_to_subcomponent(
        torch.arange(tensor_input.shape[-1]).unsqueeze(dim=0).unsqueeze(dim=0), component, model_type, model_config
    )
    start_index, end_index = meta_component.min().tolist(), meta_component.max().tolist() + 1  # host tensors
    last_dim = meta_component.shape[-1]
    _batch_idx = torch.arange(tensor_input.shape[0], device=device).unsqueeze(1)

    if unit in {"t"}:
        tensor_input[_batch_idx, start_index:end_index] = replacing_tensor_input
        return tensor_input
    if unit in {"pos"}:
        positions = unit_locations[0] if use_fast else unit_locations
        tensor_input[_batch_idx, positions, start_index:end_index] = replacing_tensor_input
        return tensor_input
    if unit in {"h", "h.pos"}:
        old_shape = tensor_input.size()  # b_s, s, -1*num_h*d
        new_shape = tensor_input.size()[:-1] + (-1, meta_component.shape[1], last_dim)  # b_s, s, -1, num_h, d
        mapping = type_to_module_mapping[model_type]
        if component in mapping and len(mapping[component]) > 2 and mapping[component][2][0] == split_three:
            _slice_idx = mapping[component][2][1]
        else:
            _slice_idx = 0
        tensor_permute = tensor_input.view(new_shape).permute(0, 3, 2, 1, 4)  # b_s, num_h, -1, s, d
        if "." in unit:
            for i in range(unit_locations[0].shape[-1]):  # two advanced indices cannot be paired otherwise
                tensor_permute[_batch_idx, unit_locations[0][:, [i]], _slice_idx, unit_locations[1]] = (
                    replacing_tensor_input[:, i]
                )
        else:
            tensor_permute[_batch_idx, unit_locations, _slice_idx] = replacing_tensor_input
        return tensor_permute.permute(0, 3, 2, 1, 4).view(old_shape)
    if "." in unit:
        for i in range(unit_locations[0].shape[-1]):
            tensor_input[_batch_idx, unit_locations[0][:, [i]], unit_locations[1]] = replacing_tensor_input[:, i]
    else:
        tensor_input[_batch_idx, unit_locations] = replacing_tensor_input
    return tensor_input


FIX = Fix(
    __name__,
    sites=(
        Site((modeling_utils, "gather_neurons"), _wrap_gather_neurons, kind="replace",
             reexported_in=(intervenable_base,)),  # star-imported there
        Site((modeling_utils, "scatter_neurons"), _wrap_scatter_neurons, kind="replace",
             reexported_in=(intervenable_base,)),
    ),
    upstream=("pyvene",),
    on_patch=_check_signatures,
)
