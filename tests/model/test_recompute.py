"""Activation checkpointing: the recomputed forward knows it is one (so statistics count once), and the
gradients are those of the plain call, bit for bit."""

import torch

from pilotrun.model.recompute import checkpointed_call, recomputing


class Probe(torch.nn.Module):
    """A block that notes, at each forward, whether it runs as the original or as the recomputation."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.seen: list[bool] = []

    def forward(self, x):
        self.seen.append(recomputing())
        return torch.tanh(self.linear(x))


def test_the_forward_runs_twice_and_only_the_second_is_a_recomputation():
    probe = Probe()
    x = torch.randn(4, 8, requires_grad=True)
    out = checkpointed_call(probe, x)
    assert probe.seen == [False] and not recomputing()
    out.sum().backward()
    assert probe.seen == [False, True] and not recomputing()


def test_gradients_equal_the_plain_call_bit_for_bit():
    torch.manual_seed(0)
    probe = Probe()
    x = torch.randn(4, 8)
    plain_input = x.clone().requires_grad_(True)
    probe(plain_input).pow(2).sum().backward()
    plain = [p.grad.clone() for p in probe.parameters()] + [plain_input.grad.clone()]
    probe.zero_grad()
    checked_input = x.clone().requires_grad_(True)
    checkpointed_call(probe, checked_input).pow(2).sum().backward()
    checked = [p.grad for p in probe.parameters()] + [checked_input.grad]
    assert all(torch.equal(a, b) for a, b in zip(plain, checked, strict=True))


def test_the_flag_is_cleared_when_the_recomputation_raises():
    class Fails(Probe):
        def forward(self, x):
            if recomputing():
                raise RuntimeError("recomputation failed")
            return super().forward(x)

    block = Fails()
    out = checkpointed_call(block, torch.randn(2, 8, requires_grad=True))
    try:
        out.sum().backward()
    except RuntimeError:
        pass
    assert not recomputing()
