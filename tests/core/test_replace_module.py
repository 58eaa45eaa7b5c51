"""core.layer.replace_module / rebuild: the one way every adapter's convert changes a module's type (modules replaced,
never retyped): the same parameter and buffer objects, submodules, hooks (their handles still remove them) and
train/eval mode; the parent's state_dict keys unchanged; the old module left as it was."""
import pytest
import torch
from torch import nn

from pid_plugins.core.layer import rebuild, replace_module


class Scaled(nn.Linear):
    """A subclass that adds behaviour, no tensors (as the adapters' method classes)."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_replace_keeps_tensors_hooks_mode_and_keys():
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    old = parent[0]
    old.register_buffer("extra", torch.ones(1), persistent=False)
    parent.eval()
    calls = []
    handle = old.register_forward_hook(lambda m, a, out: calls.append(type(m).__name__))
    keys, weight = list(parent.state_dict()), old.weight
    x = torch.randn(2, 3)
    want = parent(x)

    new = replace_module(parent, "0", Scaled)
    assert parent[0] is new and type(new) is Scaled and type(old) is nn.Linear
    assert new.weight is weight and new.bias is old.bias and new.extra is old.extra
    assert "extra" in new._non_persistent_buffers_set and list(parent.state_dict()) == keys
    assert not new.training
    torch.testing.assert_close(parent(x), torch.relu(2 * (x @ weight.T + old.bias)))
    assert calls == ["Linear", "Scaled"]  # the hook registered on the old module fires on the new one
    handle.remove()
    parent(x)
    assert calls == ["Linear", "Scaled"]  # and its handle removes it
    # back to the stock class: the stock function, the same tensors
    back = replace_module(parent, "0", nn.Linear)
    assert type(back) is nn.Linear and back.weight is weight
    torch.testing.assert_close(parent(x), want)
    new.register_parameter("added", nn.Parameter(torch.zeros(1)))  # containers are the new module's own
    assert "added" not in back._parameters and "added" not in old._parameters


def test_a_module_of_the_same_type_is_kept_and_unrelated_types_are_refused():
    parent = nn.Sequential(nn.Linear(2, 2))
    assert replace_module(parent, "0", nn.Linear) is parent[0]
    with pytest.raises(TypeError, match="rebuild: a Conv1d can be rebuilt from its own class or a base of it"):
        rebuild(parent[0], nn.Conv1d)
