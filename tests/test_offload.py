"""Layer offloading (``sdslim_core/modules/offload.py``): each layer's tensors copied to the compute device for its
own call, the layers' own tensors never moved. Checked on the emulated device (CUDA's placement rules, the CPU's
values), against the same module run on the device whole."""
import copy

import pytest
import torch
from torch import nn

from emulated_device import on
from sdslim_core.modules import offload, swap


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 4, 1)).eval()


def test_an_offloaded_module_computes_what_it_computes_on_the_device_and_keeps_its_tensors_home():
    net, x = _net(), torch.randn(2, 3, 6, 6)
    own = {n: t for n, t in net.state_dict(keep_vars=True).items()}
    with on("emulated") as dev:
        whole = copy.deepcopy(net).to(dev)
        ref = whole(x.to(dev))
        ref.pow(2).sum().backward()          # input gradients flow through the frozen layers' copies
        handles = offload.attach(net, dev)
        assert swap.layer_device(net) == dev and offload.target(net[1]) == dev
        xin = x.to(dev).requires_grad_(True)
        got = net(xin)
        got.pow(2).sum().backward()
        assert torch.equal(got.cpu(), ref.cpu())
        assert {n: t for n, t in net.state_dict(keep_vars=True).items()} == own     # the same objects, at home
        assert {t.device.type for t in net.state_dict().values()} == {"cpu"}
        assert xin.grad is not None and xin.grad.device == dev
        # a deep copy (a site copied to the device) keeps the hooks but no target: it runs where it is put
        copied = copy.deepcopy(net)
        offload.detach(copied, [])
        assert torch.equal(copied.to(dev)(x.to(dev)).cpu(), ref.cpu())
        offload.detach(net, handles)
        assert offload.target(net) is None and not net[0]._forward_pre_hooks
        with pytest.raises(RuntimeError, match="same device"):         # back to a plain CPU module
            net(x.to(dev))


def test_a_call_that_raises_still_gives_the_layer_its_own_tensors_back():
    net = _net()
    with on("emulated") as dev:
        offload.attach(net, dev)
        with pytest.raises(RuntimeError):
            net[0](torch.randn(2, 5, 6, 6).to(dev))         # wrong channels: the conv raises inside its call
    assert isinstance(net[0].weight, nn.Parameter) and net[0].weight.device.type == "cpu"


def test_no_layer_is_hooked_twice():
    """A module built from offloaded layers (a folded site holding the teacher's norm) is offloaded in turn: only its
    own new layers get hooks."""
    net = _net()
    first = offload.attach(net[3], "cpu")
    assert len(first) == 2 and offload.target(net[0]) is None
    again = offload.attach(net, "cpu")
    assert len(again) == 2 * 2 and offload.target(net[0]) == torch.device("cpu")    # conv, norm (the SiLU: none)
    assert len(net[3]._forward_pre_hooks) == len(net[3]._forward_hooks) == 1
