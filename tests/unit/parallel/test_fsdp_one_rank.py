"""A shard group of one rank computing in fp32: the unsharded parameter is the shard itself, so
unsharding copies nothing and the weights are held once; gradients over microbatches, and the forward
after an in-place update of the shard (an optimizer step), are the plain module's."""

import copy

import torch
from torch.autograd.profiler import profile

from parallel.fsdp import FSDPConfig, fully_shard
from parallel.fsdp.flat_param import unflatten
from tests.unit.parallel.toy_blocks import two_blocks


def _models(world, **cfg):
    reference = two_blocks()
    model = copy.deepcopy(reference)
    return reference, model, fully_shard(model, ["0", "1"], world, None, FSDPConfig(**cfg))


def test_one_rank_units_alias_their_shard_and_train_as_the_plain_module(world):
    inputs = torch.randn(2, 3, 4, 8)  # steps x microbatches x batch x features
    for reshard, concat in ((True, True), (False, True), (True, False)):
        reference, model, root = _models(world, reshard_after_forward=reshard, optimize_backward_concat=concat)
        for step_inputs in inputs:
            with profile(record_shapes=True) as prof:
                for mb, x in enumerate(step_inputs):
                    root.set_microbatch(is_first=mb == 0, is_last=mb == len(step_inputs) - 1)
                    model(x).square().sum().backward()
                root.finish_gradient_sync()
            flat = [[unit.spec.padded] for unit in root.units]
            assert not [e for e in prof.function_events if e.name == "aten::copy_" and e.input_shapes[0] in flat]
            for x in step_inputs:
                reference(x).square().sum().backward()
            with torch.no_grad():
                for unit in root.units:
                    for name, grad in unflatten(unit.flat_param.grad, unit.spec).items():
                        param = reference.get_submodule(unit.name).get_parameter(name)
                        torch.testing.assert_close(grad, param.grad, rtol=1e-6, atol=0)
                        param -= 0.1 * param.grad
                    unit.flat_param -= 0.1 * unit.flat_param.grad
                    assert unit.full.untyped_storage().data_ptr() == unit.flat_param.untyped_storage().data_ptr()
                    assert unit.memory_bytes()["parameters"] == unit.flat_param.numel() * 4
            reference.zero_grad(set_to_none=True)
            for unit in root.units:
                unit.flat_param.grad = None
        with torch.no_grad():  # the updated shard is what the next forward reads
            torch.testing.assert_close(model(inputs[0, 0]), reference(inputs[0, 0]), rtol=1e-6, atol=0)


def test_a_unit_computing_in_another_dtype_still_casts_into_its_own_buffer(world):
    _, _, root = _models(world, compute_dtype=torch.bfloat16)
    assert not any(unit.aliases_shard for unit in root.units)
    with torch.no_grad():
        root.units[0].unshard()
    assert root.units[0].full.dtype == torch.bfloat16
