"""The plain Trainer (``examples/hf_trainer_deepspeed.py --stage 0``, no DeepSpeed) with DeepSpeed ZeRO-3's
gradient summation order: every module's tensor inputs pass through an identity autograd Function, as
ZeRO-3's ``_post_backward_module_hook`` passes them through ``PostBackwardFunctionModule`` (DeepSpeed
0.19.8, ``runtime/zero/parameter_offload.py``). The values are untouched; autograd then sums a tensor's
gradient contributions in another order where one tensor feeds several operations (a residual stream
entering an RMSNorm: ``(pow + product) + residual`` instead of ``(residual + product) + pow``).

For tests/integrations/test_hf_trainer_deepspeed.py: this run equals ZeRO-3 on one rank bitwise, so
the difference of ZeRO-3 from the plain Trainer is that summation order and nothing else.
"""

import pathlib
import runpy
import sys

import torch

import blockshard._tiny as tiny


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _through_identity(_module: torch.nn.Module, args: tuple) -> tuple:
    return tuple(_Identity.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)


_build = tiny.tiny_llama


def _tiny_llama(*args, **kwargs):
    model = _build(*args, **kwargs)
    for module in model.modules():
        module.register_forward_pre_hook(_through_identity)
    return model


tiny.tiny_llama = _tiny_llama
examples = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(examples))  # what running the example as a script does (its _common import)
runpy.run_path(str(examples / "hf_trainer_deepspeed.py"), run_name="__main__")
