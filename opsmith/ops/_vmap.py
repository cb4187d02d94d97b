"""What the ops' vmap rules share: a batch dim moved to the front (or an
unbatched tensor expanded to the batch), and the per-example loop for the
calls that cannot be one (a batched parameter, a per-example parameter
gradient)."""
import torch


def to_front(t, bdim, batch_size):
    if t is None:
        return None
    return t.movedim(bdim, 0) if bdim is not None else t.expand(batch_size, *t.shape)


def loop(batch_size, in_dims, op, args):
    """op on each example (args with a batch dim selected at i), outputs stacked."""
    outs = []
    for i in range(batch_size):
        outs.append(op(*[a.select(d, i) if d is not None and a is not None else a
                         for a, d in zip(args, in_dims)]))
    return tuple(torch.stack(o) for o in zip(*outs))
