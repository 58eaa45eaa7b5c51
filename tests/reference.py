"""An independent, deliberately naive statement of the PID rule (PIDformer eq."""
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
