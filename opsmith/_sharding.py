"""DTensor sharding rules (tensor parallelism) for opsmith's ops.

A row-local op (a norm: every row of x is computed alone) runs locally on a
DTensor sharded on any dim but the last; sharded on the last (hidden) dim,
DTensor redistributes it to one of the accepted placements first, so the
result is right either way. The weight gradient of a row-sharded backward
is a sum over rows: each rank holds a part of it (Partial), reduced when
read.

Importing torch.distributed.tensor costs about a second, so the rules are
registered when it is first imported (a post-import hook), or at once when it
already is: a DTensor cannot reach an op before that."""
import importlib.abc
import sys
from typing import Callable, List

_PENDING: List[Callable[[], None]] = []
_WATCHED = "torch.distributed.tensor"
_DONE = False


def _register_all():
    global _DONE
    _DONE = True
    while _PENDING:
        _PENDING.pop(0)()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the pending registrations once torch.distributed.tensor has
    finished importing."""

    def find_spec(self, name, path=None, target=None):
        if name != _WATCHED:
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        real_exec = loader.exec_module

        def exec_module(module):
            real_exec(module)
            _register_all()

        loader.exec_module = exec_module
        return spec


def when_dtensor_loads(register: Callable[[], None]) -> None:
    """Calls register() now if DTensor is loaded, else right after it loads."""
    if _DONE or _WATCHED in sys.modules:
        register()
        return
    _PENDING.append(register)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def row_local(fwd_op, bwd_op, fwd_tensor_args: int, fwd_outputs: int, bwd_row_args, bwd_param_args,
              bwd_outputs_row: int, bwd_outputs_param: int, fwd_row_args: int = 1) -> None:
    """Registers the rules of a row-local op pair.

    fwd_op(*rows, *params, *non-tensor args): the first fwd_row_args tensor
    arguments (x; x and residual) and the outputs (fwd_outputs of them, all
    row-shaped) share a placement; the other tensor arguments, up to
    fwd_tensor_args in all (weights), are replicated.
    bwd_op(*args): the tensor arguments at bwd_row_args are row-shaped (dy,
    x, saved row statistics), those at bwd_param_args are replicated
    parameters; it returns bwd_outputs_row row-shaped gradients, then
    bwd_outputs_param parameter gradients (Partial sums when rows are
    sharded)."""

    def register():
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor.experimental import register_sharding

        def present(arg, placement):
            return None if arg is None or not hasattr(arg, "ndim") else placement

        @register_sharding(fwd_op)
        def fwd_rule(x, *args, **kwargs):
            params = args[fwd_row_args - 1:fwd_tensor_args - 1]
            others = [None] * (len(args) - (fwd_tensor_args - 1))
            out = []
            for d in [None] + list(range(x.ndim - 1)):
                row = Replicate() if d is None else Shard(d)
                out.append(([row] * fwd_outputs,
                            [row] * fwd_row_args + [present(p, Replicate()) for p in params] + others))
            return out

        @register_sharding(bwd_op)
        def bwd_rule(*args, **kwargs):
            ndim = args[bwd_row_args[0]].ndim
            rows_sharded = []
            for d in [None] + list(range(ndim - 1)):
                row = Replicate() if d is None else Shard(d)
                inputs = []
                for i, a in enumerate(args):
                    if i in bwd_row_args:
                        # a saved statistic has one dim fewer; rows are its leading dims
                        inputs.append(present(a, row))
                    elif i in bwd_param_args:
                        inputs.append(present(a, Replicate()))
                    else:
                        inputs.append(None)
                param = Replicate() if d is None else Partial()
                rows_sharded.append(([row] * bwd_outputs_row + [param] * bwd_outputs_param, inputs))
            return rows_sharded

    when_dtensor_loads(register)
