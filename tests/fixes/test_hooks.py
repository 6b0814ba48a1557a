"""pyvene removes its own hooks, and only those: user, profiler, ZeRO-3 and FSDP2 hooks survive."""

import dataclasses
import os

import pytest
import torch

import helpers
from pyvene_dist.testing.models import reft_model, tiny_gpt2, tiny_llama

LOCATIONS = {"sources->base": (None, [[[3]] * 2] * 2)}


def _inputs():
    return {"input_ids": torch.randint(97, (2, 8), generator=torch.Generator().manual_seed(0))}


def test_foreign_hooks_survive_a_forward(patched):
    model = reft_model(tiny_llama())
    calls = []
    layer = model.model.model.layers[0]
    layer.register_forward_hook(lambda module, args, output: calls.append("post"))
    layer.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    before = helpers.hook_counts(model)
    model(_inputs(), unit_locations=LOCATIONS)
    model(_inputs(), unit_locations=LOCATIONS)
    assert helpers.hook_counts(model) == before
    assert calls == ["pre", "post", "pre", "post"]


def test_pyvene_hooks_are_gone_after_forward(patched):
    model = reft_model(tiny_llama())
    before = helpers.hook_counts(model)
    model(_inputs(), unit_locations=LOCATIONS)
    assert helpers.hook_counts(model) == before


def test_pyvene_hooks_are_gone_after_a_failing_forward(patched):
    model = reft_model(tiny_llama())
    before = helpers.hook_counts(model)
    with pytest.raises(Exception):
        model(_inputs(), unit_locations={"sources->base": (None, [[[99]] * 2] * 2)})  # position 99 of 8
    # pyvene leaves its setter hooks behind on failure and clears them at the next call.
    model(_inputs(), unit_locations=LOCATIONS)
    assert helpers.hook_counts(model) == before


def test_intervention_still_applies(patched):
    model = reft_model(tiny_llama())
    base, counterfactual = model(_inputs(), unit_locations=LOCATIONS, output_original_output=True)
    assert not torch.allclose(base.logits, counterfactual.logits)


# -- writing into a copy where the hooked tensor aliases one autograd saved ------------------------------


@pytest.mark.parametrize("model, component", [
    ("llama", "attention_value_output"),
    ("llama", "head_attention_value_output"),
    ("gpt2", "attention_value_output"),
])
def test_attention_value_output_trains_under_sdpa_as_under_eager(patched, model, component):
    """sdpa's output, saved for its backward, is what o_proj receives: stock pyvene's in-place write at the
    second layer failed backward with ``modified by an inplace operation``. Eager attention (whose output is
    copied before o_proj) is the reference."""
    from pyvene_dist.testing import ParityCase, assert_parity, train

    eager = ParityCase(model=model, component=component, steps=1, batch_size=4)
    sdpa = dataclasses.replace(eager, attention="sdpa")
    assert_parity(train(eager), train(sdpa), eager.tolerance)


def test_sdpa_forward_is_stock_pyvene_bit_for_bit():
    """The copy changes no value: stock pyvene's forward (which runs; only its backward fails) is matched
    bit for bit."""
    import pyvene_dist
    from helpers import patch

    def logits():
        model = reft_model(tiny_llama(attention="sdpa"), component="attention_value_output")
        return model(_inputs(), unit_locations=LOCATIONS)[1].logits

    stock = logits()
    patch()
    try:
        assert torch.equal(logits(), stock)
    finally:
        pyvene_dist.unpatch()


def test_a_copy_only_where_autograd_saved_the_tensor():
    from pyvene_dist.mechanisms.copy_on_write import aliases_saved

    query = torch.randn(2, 8, 4, 8, requires_grad=True).transpose(1, 2)  # [batch, heads, positions, size]
    attended = torch.nn.functional.scaled_dot_product_attention(query, query, query)
    value_output = attended.transpose(1, 2).contiguous().reshape(2, 8, 32)  # what o_proj receives
    assert value_output._base is not None and aliases_saved(value_output)
    assert aliases_saved(torch.softmax(query, -1))  # softmax saves its result
    assert not aliases_saved(torch.matmul(query, query).transpose(1, 2).contiguous())  # eager: a copy
    assert not aliases_saved(torch.nn.functional.linear(query, torch.randn(8, 8)))  # saves input, weight
    assert not aliases_saved(torch.softmax(query.detach(), -1))  # nothing recorded


class _ViewAttention(torch.autograd.Function):
    """Attention as flex attention's compiled function returns it on a GPU: a ``[batch, heads, positions,
    size]`` view, made inside the Function, of a buffer laid out ``[batch, positions, heads, size]``."""

    @staticmethod
    def forward(ctx, query, key, value):
        ctx.save_for_backward(query, key, value)
        attended = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                                    enable_gqa=True)
        return attended.transpose(1, 2).contiguous().transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
            attended = torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=True)
            return torch.autograd.grad(attended, inputs, grad)


def _view_attention(module, query, key, value, attention_mask, **kwargs):
    return _ViewAttention.apply(query, key, value).transpose(1, 2).contiguous(), None  # .contiguous(): a view


def test_a_view_made_inside_a_custom_function_is_written_as_a_copy():
    """Under flex attention on the H200, o_proj's input was a view of flex's compiled function's output, and
    pyvene's in-place write at two layers failed: 'A view was created in no_grad mode and is being modified
    inplace ... This view was created inside a custom Function'. Here an attention of the same layout,
    through transformers' attention registry, on the CPU: stock pyvene fails so, the patched model trains."""
    from transformers import AttentionInterface

    import pyvene_dist

    AttentionInterface.register("view_attention", _view_attention)

    def train_step():
        model = reft_model(tiny_llama(), layers=(0, 1), component="attention_value_output")
        model.model.config._attn_implementation = "view_attention"
        _, output = model(_inputs(), unit_locations=LOCATIONS, labels=_inputs()["input_ids"])
        output.loss.backward()
        return [p.grad for p in model.interventions.parameters() if p.requires_grad]

    if os.environ.get(helpers.UPSTREAM_ENV):  # a pyvene that carries hooks.diff trains as it is
        assert all(grad is not None for grad in train_step())
    else:
        with pytest.raises(RuntimeError, match="created inside a custom Function"):
            train_step()
    helpers.patch()
    try:
        assert all(grad is not None and torch.isfinite(grad).all() for grad in train_step())
    finally:
        pyvene_dist.unpatch()


def test_views_autograd_refuses_writes_to_are_copied():
    from pyvene_dist.mechanisms.copy_on_write import forbids_writes, must_copy

    x = torch.randn(2, 3, 4, requires_grad=True)
    made_inside = _ViewAttention.apply(x[None], x[None], x[None])
    assert forbids_writes(made_inside) and must_copy(made_inside)
    assert all(forbids_writes(part) for part in (x * 2).split(1))  # one of several views of one function
    with torch.no_grad():
        made_without_grad = x[0]
    assert forbids_writes(made_without_grad)
    assert not forbids_writes((x * 2)[0]) and not forbids_writes(x * 2)  # a plain view; no view


class _SavesItsOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, keep_output):
        y = x * 2
        ctx.save_for_backward(y if keep_output else x)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


def test_a_custom_functions_saved_output_is_seen():
    """A custom autograd.Function keeps what it saved in ``saved_tensors``, not in ``_saved_*``: flex
    attention's compiled function saved its output, and a second intervened layer wrote into it in place on
    the H200 ('modified by an inplace operation ... output 0 of CompiledFunctionBackward')."""
    from pyvene_dist.mechanisms.copy_on_write import aliases_saved

    x = torch.randn(3, 4, requires_grad=True)
    assert aliases_saved(_SavesItsOutput.apply(x, True))
    assert not aliases_saved(_SavesItsOutput.apply(x, False))
    compiled = torch.compile(lambda t: torch.sigmoid(t * 3), backend="aot_eager", fullgraph=True)
    output = compiled(x)
    assert type(output.grad_fn).__name__ == "CompiledFunctionBackward"
    saved = {t.untyped_storage().data_ptr() for t in output.grad_fn.saved_tensors}
    assert output.untyped_storage().data_ptr() in saved  # sigmoid's backward reads its result
    assert aliases_saved(output)
    output.sum().backward()  # freed after backward: nothing is held, nothing to protect
    assert not aliases_saved(output)


@pytest.mark.world_size(1, backend="gloo")  # a CPU mesh: under nccl a CPU DTensor has no backend
def test_a_dtensor_is_checked_through_its_local_shard():
    """Tensor parallel hands hooks DTensors, which have no storage of their own: the check read theirs and
    tensor parallel at mlp_activation failed ('Attempted to access the data pointer on an invalid python
    storage')."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pyvene_dist.mechanisms.copy_on_write import aliases_saved

    mesh = init_device_mesh("cpu", (1,))
    weight = distribute_tensor(torch.randn(4, 4, requires_grad=True), mesh, [Shard(0)])
    assert aliases_saved(torch.relu(weight * 2))  # relu saves its result
    assert not aliases_saved(weight * 2)  # a product with a number saves neither side


def test_attention_weight_is_refused_where_the_model_never_computes_it(patched):
    """GPT-2's attn.attn_dropout, which pyvene hooks for attention_weight, runs under eager attention with
    reorder_and_upcast_attn only (transformers 5): elsewhere stock pyvene applied no intervention, silently."""
    if os.environ.get(helpers.UPSTREAM_ENV):
        pytest.skip("the refusal is runtime-only: hooks.diff does not carry it, and patch() leaves fixes.hooks, "
                    "the refusal with it, off for a pyvene that carries hooks.diff (docs/upstreaming.md)")
    inputs, locations = _inputs(), {"sources->base": (None, [[[3]] * 2])}
    for attention, reorder, why in [("sdpa", True, "attn_implementation is 'sdpa', expected 'eager'"),
                                    ("eager", False, "reorder_and_upcast_attn=True, found False")]:
        base = tiny_gpt2(attention=attention)
        base.config.reorder_and_upcast_attn = reorder
        model = reft_model(base, layers=(0,), component="attention_weight")
        with pytest.raises(ValueError, match=f"'attention_weight', which this model never computes.*{why}"):
            model(inputs, unit_locations=locations)
    from transformers import GPT2LMHeadModel

    config = tiny_gpt2().config
    config.reorder_and_upcast_attn = True  # read as the layers are built
    model = reft_model(GPT2LMHeadModel(config), layers=(0,), component="attention_weight")
    # pyvene sizes the intervention to max_position_embeddings: the probabilities' last axis at full length
    full = {"input_ids": torch.randint(97, (2, config.n_positions), generator=torch.Generator().manual_seed(0))}
    original, intervened = model(full, unit_locations=locations, output_original_output=True)
    assert not torch.equal(original.logits, intervened.logits)  # computed there, and the intervention acts
