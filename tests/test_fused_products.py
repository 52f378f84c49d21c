"""The stacked weights of the fused decode products (CPU): the modules keep computing what they
did, as views of the stacks, and the model does not grow."""

from __future__ import annotations

import copy

import torch
from torch import nn

from vlm_server.models.common.fused_products import stack_block
from vlm_server.models.interface import LoadedModel


def _block(seed: int) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    return nn.Linear(8, 24), nn.Linear(8, 32), nn.Linear(8, 8), nn.Linear(32, 8)


def test_stacking_keeps_every_module_output_and_shares_the_storage() -> None:
    mods = _block(0)
    before = copy.deepcopy(mods)
    x, h = torch.randn(3, 8), torch.randn(3, 32)
    prod = stack_block(*mods)
    qkv, fc1, proj, fc2 = mods
    for new, old, inp in zip(mods, before, (x, x, x, h), strict=True):
        torch.testing.assert_close(new(inp), old(inp), rtol=0, atol=0)
    assert qkv.weight.data_ptr() == prod.w_in.data_ptr()
    assert fc1.weight.data_ptr() == prod.w_in[24:].data_ptr()
    assert proj.weight.data_ptr() == prod.w_out.data_ptr()
    assert fc2.weight.data_ptr() == prod.w_out[:, 8:].data_ptr()
    assert prod.w_in.shape == (56, 8) and prod.w_out.shape == (8, 40) and prod.n_qkv == 24
    want = proj.bias + fc2.bias
    torch.testing.assert_close(prod.b_out, want)
    # The stacked products' math, in plain PyTorch, is the four products'.
    both = x @ prod.w_in.t() + prod.b_in
    torch.testing.assert_close(both[:, :24], qkv(x))
    torch.testing.assert_close(both[:, 24:], fc1(x))
    branch = torch.cat([x, h], 1) @ prod.w_out.t() + prod.b_out
    torch.testing.assert_close(branch, proj(x) + fc2(h))


def test_the_fused_products_stay_off_on_the_cpu(tiny: LoadedModel) -> None:
    model = copy.deepcopy(tiny.model)
    assert model.text.use_fused_products(True) is False
    assert model.text._stacked is None
