"""An independent, deliberately naive statement of the PID rule (PIDformer eq. 25): loops over layers, batch, heads and
positions in float64, written from the equation, not from pid_plugins.core."""
import torch


def naive_pid_stack(attn_outs, values, lp, li, ld, beta, control_first_layer=True):
    """attn_outs[l]: (B, H, N, D); values[l]: (B, Hkv, N, D) -> the controlled outputs per layer (``control_first_layer=
    False``: the first layer only provides v^1, the errors start at the second, NeuTRENO's convention)."""
    B, H, N, D = attn_outs[0].shape
    Hkv = values[0].shape[1]
    group = H // Hkv
    L = len(attn_outs)
    outs = [torch.zeros(B, H, N, D, dtype=torch.float64) for _ in range(L)]
    for b in range(B):
        for h in range(H):
            g = h // group  # the key/value head serving query head h
            for i in range(N):
                v1 = values[0][b, g, i].double()
                running = torch.zeros(D, dtype=torch.float64)
                previous = None
                for l in range(L):
                    if l == 0 and not control_first_layer:
                        outs[0][b, h, i] = attn_outs[0][b, h, i].double()
                        continue
                    e = beta * v1 - values[l][b, g, i].double()
                    running = running + e
                    derivative = torch.zeros(D, dtype=torch.float64) if previous is None else e - previous
                    outs[l][b, h, i] = attn_outs[l][b, h, i].double() + lp * e + li * running + ld * derivative
                    previous = e
    return outs


def naive_mmseg_layers(layers, h, heads, gains=None, control_first_layer=True, rule=None):
    """mmseg ``TransformerEncoderLayer``s run as one group by hand (:func:`zoo_cases.mmseg_layers`) with PID's rule
    (``gains``) or ``rule(attn_outs, values)``; returns the tokens."""
    from zoo_cases import mmseg_layers, on_outputs

    if rule is None:
        def rule(attn_outs, values):
            return naive_pid_stack(attn_outs, values, *gains, control_first_layer=control_first_layer)
    assert all(layer.attn.attn.num_heads == heads for layer in layers)
    return mmseg_layers(layers, h, on_outputs(lambda attn_outs, values: rule(attn_outs, values)[-1]))
