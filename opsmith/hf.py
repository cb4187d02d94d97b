"""Hugging Face models on opsmith's kernels, in one call.

    import opsmith.hf
    opsmith.hf.patch(model)                  # a built model: modules swapped, weights kept
    opsmith.hf.patch(LlamaForCausalLM)       # the classes, before from_pretrained / from_config
    opsmith.hf.patch_gemma(rope=False)       # one architecture's classes, with options

What is replaced, per architecture (`SUPPORTED`):
- rms_norm: the architecture's RMSNorm modules compute through opsmith.rms_norm
  with the casting the architecture uses (Llama-like: x_hat rounded to the input
  dtype before the weight multiply, output in the promoted dtype; Gemma: float32
  throughout, `(1 + weight)`, output in the input dtype). Parameters and
  state-dict keys are unchanged.
- glu: the gated MLP's `act(gate_proj(x)) * up_proj(x)` becomes one opsmith
  kernel (SwiGLU for SiLU, GeGLU for the GELU variants). An activation opsmith
  does not have leaves that MLP as it is.
- rope: the modeling module's `apply_rotary_pos_emb` (a module-level function
  in Hugging Face: patching it affects every model of that architecture in the
  process) becomes opsmith.apply_rotary_pos_emb, where opsmith has it.
- cross_entropy: the causal-LM loss (`loss_function`: shift, flatten,
  cross-entropy with ignore_index and num_items_in_batch) computes through
  opsmith.cross_entropy on the logits as they are, with float32 math inside the
  kernel in place of an upcast float32 copy of the logits, where opsmith has it.
- fused_linear_cross_entropy: when training with labels, the causal LM's
  forward takes the loss from the last hidden states and the lm_head weight
  through opsmith.fused_linear_cross_entropy, never making the logits (Gemma 2's
  final logit softcapping included); logits as before otherwise.
- with rms_norm, when training: each decoder layer's norm outputs are not
  kept for the projections' weight gradients but made again in the backward
  from the norm's input (norm_recompute; glu_recompute does the same for the
  MLP's act(gate) * up).

A model instance is patched in place: each module's class becomes an opsmith
subclass of its Hugging Face class (isinstance still holds, parameters and
buffers are the same objects). Patching classes replaces the module-level
names the modeling code looks up when it builds a model, so every model built
afterwards uses opsmith; the causal LM's forward and loss are set on the
Hugging Face class itself, so a model of that class built before takes the
fused loss as well (its norms and MLPs stay as they were). Patching twice is
harmless; the recompute options of a class patch hold for every model built
from it. A patched model saves through state_dict() or save_pretrained() (its
weights are the Hugging Face model's), and pickles whole (torch.save(model),
copy.deepcopy): its patched modules (norms, MLPs, decoder layers, an
instance's fused-loss causal LM) load back patched, with their recompute
options, in a process that never patched too. What a patch sets outside the
model -- rotary's apply_rotary_pos_emb in the modeling module, a class
patch's forward and loss on the Hugging Face class -- belongs to the process:
patch again there for it.
"""
import copyreg
import importlib
import inspect
import threading
from typing import Callable, Dict, Optional, Tuple

import torch

import opsmith
from opsmith.ops.glu import GatedDownProjection, _glu_fwd

# model_type -> (modeling module, RMSNorm class name, MLP class name, causal-LM class name, norm style)
SUPPORTED: Dict[str, Tuple[str, str, str, str, str]] = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "LlamaMLP", "LlamaForCausalLM", "llama"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm", "MistralMLP", "MistralForCausalLM",
                "llama"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm", "Qwen2MLP", "Qwen2ForCausalLM", "llama"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm", "Qwen3MLP", "Qwen3ForCausalLM", "llama"),
    "gemma": ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", "GemmaMLP", "GemmaForCausalLM", "gemma"),
    "gemma2": ("transformers.models.gemma2.modeling_gemma2", "Gemma2RMSNorm", "Gemma2MLP", "Gemma2ForCausalLM",
               "gemma"),
}


class UnsupportedModelError(ValueError):
    """A model type opsmith.hf does not know."""


def _unsupported(what) -> UnsupportedModelError:
    return UnsupportedModelError(f"opsmith.hf: {what} is not a supported model type; supported: "
                                 f"{', '.join(sorted(SUPPORTED))}")


# --- replacement forwards ----------------------------------------------------------------

def _norm_eps(module) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise AttributeError(f"opsmith.hf: {type(module).__name__} has neither variance_epsilon nor eps")


def _llama_norm(self, hidden_states):
    # LlamaRMSNorm: x_hat in float32, rounded to the input dtype, times the
    # weight in the promoted dtype
    return opsmith.rms_norm(hidden_states, self.weight, _norm_eps(self), casting_mode="llama")


def _gemma_norm(self, x):
    # GemmaRMSNorm: float32 throughout, (1 + weight), output in x's dtype
    return opsmith.rms_norm(x, self.weight, _norm_eps(self), offset=1.0, casting_mode="gemma")


def _llama_rms_norm_forward(self, hidden_states):
    return _recomputable(_llama_norm, self, hidden_states)


def _gemma_rms_norm_forward(self, x):
    return _recomputable(_gemma_norm, self, x)


# --- norm outputs made again in the backward ------------------------------------------------
# While a patched decoder layer's forward runs (training, norm_recompute), a
# tensor autograd saves that is a patched norm's output, or a view of it (what
# q/k/v_proj and gate/up_proj keep for their weight gradients), is kept as the
# norm's input instead, which the norm's own backward keeps anyway; the
# backward runs the norm's forward again (same kernel, same bits) once for
# all of that output's users. Saved-tensor hooks that are already active
# (gradient checkpointing, offloading, a user's) win: the layer then runs as
# it would unpatched.

class _NormRecompute:
    __slots__ = ("norm", "module", "x", "versions", "output_version", "packed", "unpacked", "y")

    def __init__(self, norm, module, x, output_version):
        self.norm, self.module, self.x = norm, module, x
        self.versions = self._versions()
        self.output_version = output_version  # changed in place since (a hook): saved as it is
        self.packed = self.unpacked = 0
        self.y = None

    def _versions(self):
        weight = getattr(self.module, "weight", None)
        return self.x._version, None if weight is None else weight._version

    def output(self):
        if self.y is None:
            if self._versions() != self.versions:
                raise RuntimeError(f"opsmith.hf: the input or weight of a {type(self.module).__name__} was modified "
                                   f"in place after its forward; its output cannot be made again for the backward "
                                   f"(patch with norm_recompute=False to keep it instead)")
            with torch.no_grad():
                self.y = self.norm(self.module, self.x)
        y = self.y
        self.unpacked += 1
        if self.unpacked >= self.packed:
            # every saved use unpacked: dropped, and a next backward through
            # the same graph (retain_graph) makes it again, once for its uses
            self.y = None
            self.unpacked = 0
        return y


_recompute_scope = threading.local()


def _recomputable(norm, module, x):
    y = norm(module, x)
    if getattr(_recompute_scope, "active", False) and y.requires_grad and type(y) is torch.Tensor \
            and y.is_contiguous():
        y._opsmith_recompute = _NormRecompute(norm, module, x.detach(), y._version)
    return y


def _pack(t):
    if type(t) is not torch.Tensor:  # subclasses (DTensor): as they are
        return t
    base = t if t._base is None else t._base
    recompute = getattr(base, "_opsmith_recompute", None)
    if recompute is None or t.dtype != base.dtype or base._version != recompute.output_version:
        return t
    recompute.packed += 1
    if t is base:
        return recompute, None
    return recompute, (t.size(), t.stride(), t.storage_offset() - base.storage_offset())


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    recompute, view = packed
    y = recompute.output()
    return y if view is None else y.as_strided(*view)


def _other_saved_tensor_hooks() -> bool:
    """Saved-tensor hooks are set already, or disabled (torch.func transforms)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    if top is None or enabled is None:  # unknown: assume so, take the usual path
        return True
    return not enabled() or top(False) is not None


def _decoder_layer_forward(base: type) -> Callable:
    def forward(self, *args, **kwargs):
        if not (getattr(self, "_opsmith_norm_recompute", True) and torch.is_grad_enabled()) \
                or torch.compiler.is_compiling() or getattr(_recompute_scope, "active", False) \
                or _other_saved_tensor_hooks():
            return base.forward(self, *args, **kwargs)
        _recompute_scope.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                return base.forward(self, *args, **kwargs)
        finally:
            _recompute_scope.active = False
    return forward


def _glu_activation(act) -> Optional[str]:
    """The GLU kernel's activation ("silu", "gelu", "gelu_tanh") for an MLP's
    activation module, or None when opsmith has no kernel for it."""
    name = type(act).__name__
    if isinstance(act, torch.nn.SiLU) or name in ("SiLUActivation", "SiLU"):
        return "silu"
    if name in ("PytorchGELUTanh", "GELUTanh", "NewGELUActivation", "GELUPytorchTanh", "FastGELUActivation"):
        return "gelu_tanh"
    if name == "GELUActivation" or (isinstance(act, torch.nn.GELU) and act.approximate == "none"):
        return "gelu"
    if isinstance(act, torch.nn.GELU) and act.approximate == "tanh":
        return "gelu_tanh"
    return None


def _unhooked(m) -> bool:
    # no module hooks that a fused path would skip: the module's own forward,
    # forward-pre, backward and backward-pre hooks, or global ones
    from torch.nn.modules import module as _module
    own = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    glob = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
            "_global_backward_pre_hooks")
    return not any(getattr(m, k, None) for k in own) and not any(getattr(_module, k, None) for k in glob)


def _plain_linear(m) -> bool:
    # a torch.nn.Linear that its own forward would compute as F.linear: no
    # subclass (LoRA, quantised layers), no hooks (_unhooked)
    return type(m) is torch.nn.Linear and _unhooked(m)


def _slice_logits_to_keep(hidden, logits_to_keep):
    try:  # Hugging Face's own (2-D positions and masks too), where it has one
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # pragma: no cover (older transformers: an int or 1-D positions)
        if isinstance(logits_to_keep, int):
            return hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden
        return hidden[:, logits_to_keep, :]
    return slice_logits_to_keep(hidden, logits_to_keep)


def _mlp_forward(self, x):
    # an activation opsmith has no kernel for (set after patching), or one with hooks: as Hugging Face computes
    activation = _glu_activation(self.act_fn) if _unhooked(self.act_fn) else None
    if activation is None:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    gate, up = self.gate_proj(x), self.up_proj(x)
    if getattr(self, "_opsmith_glu_recompute", True) and torch.is_grad_enabled() and _plain_linear(self.down_proj):
        # training: act(gate) * up is not kept for down_proj's weight gradient
        # but made again in the backward's GLU pass (one rows x I tensor an MLP
        # less memory, the same gradients)
        return GatedDownProjection.apply(gate, up, self.down_proj.weight, self.down_proj.bias, activation)
    return self.down_proj(_glu_fwd(gate, up, activation))


def _shifted_labels(labels, ignore_index: int, shift_labels=None):
    if shift_labels is None:
        # Hugging Face's shift: pad, then drop the first; the last position is ignored
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels


def _per_item(loss, num_items_in_batch):
    # Hugging Face's gradient accumulation: a sum over the tokens divided by the items of the whole batch
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss.float()


def causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                   shift_labels=None, **kwargs):
    """Hugging Face's ForCausalLMLoss through opsmith.cross_entropy: the same
    shift, flatten, ignore_index and num_items_in_batch handling, without the
    float32 copy of the logits (the kernel computes in float32). The loss is
    float32, unrounded, as Hugging Face's own path gives (it upcasts the
    logits first), and so is the sum divided by num_items_in_batch."""
    shift_labels = _shifted_labels(labels, ignore_index, shift_labels)
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    loss = opsmith.cross_entropy(logits, shift_labels, ignore_index=ignore_index,
                                 reduction="sum" if num_items_in_batch is not None else "mean",
                                 loss_dtype=None if logits.dtype == torch.float64 else torch.float32)
    return _per_item(loss, num_items_in_batch)


def fused_causal_lm_loss(hidden_states, lm_head: torch.nn.Linear, labels, num_items_in_batch=None,
                         ignore_index: int = -100, shift_labels=None, softcap=None, **kwargs):
    """The causal-LM loss from the last hidden states and the lm_head, through
    opsmith.fused_linear_cross_entropy: Hugging Face's shift, ignore_index and
    num_items_in_batch handling, without the [tokens, vocab] logits (forward
    or backward). Returns a float32 scalar."""
    shift_labels = _shifted_labels(labels, ignore_index, shift_labels)
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    t = shift_labels.reshape(-1).to(h.device)
    loss = opsmith.fused_linear_cross_entropy(h, lm_head.weight, t, bias=lm_head.bias, ignore_index=ignore_index,
                                              reduction="sum" if num_items_in_batch is not None else "mean",
                                              softcap=softcap)
    return _per_item(loss, num_items_in_batch)


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, skip_logits=None,
                       **kwargs):
    """The causal LM's forward with the loss through fused linear
    cross-entropy: when training with labels (or skip_logits=True) the loss
    comes from the hidden states and the lm_head weight and no logits are made
    (the output's logits are None); otherwise Hugging Face's path (logits, and
    the loss from them when labels are given). An lm_head that is not a plain
    torch.nn.Linear (a LoRA adapter, a quantised layer) or has module hooks
    (forward or backward) takes
    Hugging Face's path, so that its own forward runs."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden = outputs.last_hidden_state
    softcap = getattr(self.config, "final_logit_softcapping", None)
    if skip_logits is None:
        skip_logits = self.training and labels is not None and torch.is_grad_enabled()
    if skip_logits and labels is None and kwargs.get("shift_labels") is None:
        raise ValueError("skip_logits=True needs labels (the loss is all such a forward computes)")
    logits = loss = None
    if skip_logits and _plain_linear(self.lm_head):
        loss = fused_causal_lm_loss(hidden, self.lm_head, labels, softcap=softcap, **kwargs)
    else:
        logits = self.lm_head(_slice_logits_to_keep(hidden, logits_to_keep))
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        if skip_logits:  # asked for no logits: the loss alone, as the fused path gives it
            logits = None
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _tuple_aware(forward):
    # Hugging Face's forwards return a tuple for return_dict=False (can_return_tuple)
    try:
        from transformers.utils.generic import can_return_tuple
    except ImportError:  # pragma: no cover (older transformers)
        return forward
    return can_return_tuple(forward)


_FUSED_FORWARD = _tuple_aware(_causal_lm_forward)


# --- subclasses ----------------------------------------------------------------------------

_SUBCLASSES: Dict[type, type] = {}


def _kind_forward(kind: str, base: type) -> Callable:
    if kind == "decoder_layer":
        return _decoder_layer_forward(base)
    return {"llama_norm": _llama_rms_norm_forward, "gemma_norm": _gemma_rms_norm_forward, "mlp": _mlp_forward,
            "causal_lm": _FUSED_FORWARD}[kind]


def _opsmith_subclass(base: type, kind: str) -> type:
    """One subclass per Hugging Face class, with the forward of `kind`
    (llama_norm, gemma_norm, mlp, decoder_layer, causal_lm); a class that is
    already one is returned as it is."""
    if getattr(base, "_opsmith_patched", False):
        return base
    if base not in _SUBCLASSES:
        _SUBCLASSES[base] = type(base.__name__, (base,), {
            "forward": _kind_forward(kind, base), "_opsmith_patched": True, "_opsmith_kind": kind,
            "_opsmith_fused_loss": kind == "causal_lm", "__module__": base.__module__,
            "__reduce_ex__": _reduce_patched,
            "__doc__": f"{base.__name__} computing through opsmith ({__name__})."})
    return _SUBCLASSES[base]


# the options a class patch keeps on the subclass, an instance patch on the module
_PATCH_OPTIONS = ("_opsmith_glu_recompute", "_opsmith_norm_recompute")


def _reduce_patched(self, protocol):
    """Pickling (torch.save(model), copy.deepcopy): the subclass is made at run
    time and found under no importable name, so a patched module is rebuilt
    from its Hugging Face class and kind, then given its state (the options a
    class patch set on the subclass included): the copy computes through
    opsmith in a process that never patched."""
    cls = type(self)
    state = dict(self.__getstate__())
    for name in _PATCH_OPTIONS:
        if name not in state and hasattr(cls, name):
            state[name] = getattr(cls, name)
    base = cls.__mro__[1]
    # the Hugging Face class by name, not by object: after a class patch its
    # module's name is the subclass, which pickle would refuse as not the same
    return _rebuild_patched, (base.__module__, base.__qualname__, cls._opsmith_kind), state


def _by_name(module: str, qualname: str) -> type:
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _rebuild_patched(module: str, qualname: str, kind: str):
    cls = _opsmith_subclass(_unpatched(_by_name(module, qualname)), kind)
    return cls.__new__(cls)


def _reduce_unpatched(self):
    """A plain instance of a class whose module-level name a class patch
    rebound to its subclass (a model built before the patch): pickle would
    find the subclass under the name and refuse it as not the same class."""
    cls = type(self)
    return _rebuild_unpatched, (cls.__module__, cls.__qualname__), self.__getstate__()


def _rebuild_unpatched(module: str, qualname: str):
    cls = _unpatched(_by_name(module, qualname))
    return cls.__new__(cls)


def _rebind(module, base: type, patched: type) -> None:
    """The modeling module's name of base now gives patched (models built
    afterwards use it); base's own instances still pickle."""
    copyreg.pickle(base, _reduce_unpatched)
    setattr(module, base.__name__, patched)


def _available(name: str) -> bool:
    return hasattr(opsmith, name)


def _check_available(flags: Dict[str, bool]) -> None:
    need = {"rope": "apply_rotary_pos_emb", "cross_entropy": "cross_entropy",
            "fused_linear_cross_entropy": "fused_linear_cross_entropy"}
    for flag, fn in need.items():
        if flags.get(flag) is True and not _available(fn):
            raise NotImplementedError(f"opsmith.hf: {flag}=True needs opsmith.{fn}, which this build of opsmith "
                                      f"does not have; pass {flag}=False")


def _resolve(flags: Dict[str, Optional[bool]]) -> Dict[str, bool]:
    """None means: patch when opsmith has the op (rope, cross_entropy,
    fused_linear_cross_entropy); every other value must be a bool."""
    optional = {"rope": "apply_rotary_pos_emb", "cross_entropy": "cross_entropy",
                "fused_linear_cross_entropy": "fused_linear_cross_entropy"}
    for name, value in flags.items():
        if not isinstance(value, bool) and not (value is None and name in optional):
            raise TypeError(f"opsmith.hf.patch: {name} must be True or False"
                            f"{' or None' if name in optional else ''}, got {value!r}")
    _check_available(flags)
    out = dict(flags)
    for name, op in optional.items():
        if out[name] is None:
            out[name] = _available(op)
    return out


# --- what gets patched ---------------------------------------------------------------------

def _model_type_of(obj) -> str:
    if isinstance(obj, str):
        if obj not in SUPPORTED:
            raise _unsupported(repr(obj))
        return obj
    config = getattr(obj, "config", None)
    model_type = getattr(config, "model_type", None) if not inspect.isclass(obj) else None
    if model_type is None:
        cls = obj if inspect.isclass(obj) else type(obj)
        module = cls.__module__
        for name, entry in SUPPORTED.items():
            if module == entry[0]:
                model_type = name
                break
        else:
            raise _unsupported(f"{cls.__name__} (module {module})")
    if model_type not in SUPPORTED:
        raise _unsupported(repr(model_type))
    return model_type


def _classes(model_type: str):
    module_name, norm, mlp, causal_lm, style = SUPPORTED[model_type]
    module = importlib.import_module(module_name)
    return module, getattr(module, norm), getattr(module, mlp), getattr(module, causal_lm), style


def _decoder_layer_class(model_type: str) -> type:
    module_name, causal_lm = SUPPORTED[model_type][0], SUPPORTED[model_type][3]
    return getattr(importlib.import_module(module_name), causal_lm.replace("ForCausalLM", "DecoderLayer"))


def _unpatched(cls: type) -> type:
    return cls.__mro__[1] if getattr(cls, "_opsmith_patched", False) else cls


def _patched_layer(base: type) -> type:
    return _opsmith_subclass(base, "decoder_layer")


def _patch_module_names(model_type: str, flags: Dict[str, bool]) -> None:
    module, norm_cls, mlp_cls, causal_cls, style = _classes(model_type)
    if flags["rms_norm"]:
        _rebind(module, _unpatched(norm_cls), _opsmith_subclass(norm_cls, f"{style}_norm"))
        layer_cls = _decoder_layer_class(model_type)
        if flags["norm_recompute"] or getattr(layer_cls, "_opsmith_patched", False):
            patched = _patched_layer(_unpatched(layer_cls))
            patched._opsmith_norm_recompute = flags["norm_recompute"]
            _rebind(module, _unpatched(layer_cls), patched)
    if flags["glu"]:
        patched = _opsmith_subclass(mlp_cls, "mlp")
        patched._opsmith_glu_recompute = flags["glu_recompute"]
        _rebind(module, _unpatched(mlp_cls), patched)
    if flags["rope"]:
        setattr(module, "apply_rotary_pos_emb", opsmith.apply_rotary_pos_emb)
    if flags["cross_entropy"]:
        # PreTrainedModel.loss_function returns _loss_function where one is set
        causal_cls._loss_function = staticmethod(causal_lm_loss)
    if flags["fused_linear_cross_entropy"] and not getattr(causal_cls, "_opsmith_fused_loss", False):
        # the class the user calls from_pretrained on: its forward itself
        causal_cls.forward = _FUSED_FORWARD
        causal_cls._opsmith_fused_loss = True


def _patch_instance(model: torch.nn.Module, model_type: str, flags: Dict[str, bool]) -> None:
    module, norm_cls, mlp_cls, causal_cls, style = _classes(model_type)
    norm_base, mlp_base = _unpatched(norm_cls), _unpatched(mlp_cls)
    layer_base = _unpatched(_decoder_layer_class(model_type))
    for sub in model.modules():
        if flags["rms_norm"] and type(sub) is norm_base:
            sub.__class__ = _opsmith_subclass(norm_base, f"{style}_norm")
        elif flags["glu"] and type(sub) in (mlp_base, _SUBCLASSES.get(mlp_base)) and \
                _glu_activation(sub.act_fn) is not None:
            # patched before: its recompute option as this call asks
            sub.__class__ = _opsmith_subclass(mlp_base, "mlp")
            sub._opsmith_glu_recompute = flags["glu_recompute"]
        elif flags["rms_norm"] and isinstance(sub, layer_base):
            if type(sub) is layer_base and flags["norm_recompute"]:
                sub.__class__ = _patched_layer(layer_base)
            sub._opsmith_norm_recompute = flags["norm_recompute"]
    if flags["rope"]:
        setattr(module, "apply_rotary_pos_emb", opsmith.apply_rotary_pos_emb)
    if flags["cross_entropy"] and isinstance(model, causal_cls):
        model.loss_function = causal_lm_loss
    if flags["fused_linear_cross_entropy"] and isinstance(model, causal_cls) and \
            not getattr(type(model), "_opsmith_fused_loss", False):
        model.__class__ = _opsmith_subclass(type(model), "causal_lm")


def patch(model_or_class=None, *, model_type: Optional[str] = None, rms_norm: bool = True,
          rope: Optional[bool] = None, glu: bool = True, cross_entropy: Optional[bool] = None,
          fused_linear_cross_entropy: Optional[bool] = None, glu_recompute: bool = True,
          norm_recompute: bool = True):
    """Patch a built model (in place; returned), a model class, or, with
    `model_type` alone, an architecture's classes. rope / cross_entropy /
    fused_linear_cross_entropy: None patches them where opsmith has the op,
    True requires it.

    fused_linear_cross_entropy: the causal LM's forward, when training with
    labels, computes the loss from the last hidden states and the lm_head
    through opsmith.fused_linear_cross_entropy without making the logits
    (its output's logits are None then; pass skip_logits=False to the
    forward to get them); in evaluation, or without labels, it computes the
    logits as Hugging Face does.

    glu_recompute: when training, the patched MLP keeps no act(gate) * up
    for down_proj's weight gradient: the backward's GLU pass makes it again
    (one [tokens, intermediate] tensor an MLP less memory, the same
    gradients, under torch.compile too; a down_proj that is not a plain
    torch.nn.Linear, or has module hooks (forward or backward), takes the
    usual path; so does an activation module with hooks).

    norm_recompute (with rms_norm): when training, the tensors q/k/v_proj and
    gate/up_proj keep for their weight gradients, the norm's output, are not
    kept: the backward runs the norm's forward again from the input its own
    backward keeps (two [tokens, hidden] tensors a decoder layer less memory,
    the same gradients). Layers under gradient checkpointing or other
    saved-tensor hooks, and torch.compile, take the usual path.

    Raises UnsupportedModelError (listing the supported types) for a model
    type opsmith.hf does not know."""
    flags = _resolve({"rms_norm": rms_norm, "rope": rope, "glu": glu, "cross_entropy": cross_entropy,
                      "fused_linear_cross_entropy": fused_linear_cross_entropy, "glu_recompute": glu_recompute,
                      "norm_recompute": norm_recompute})
    if model_or_class is None:
        if model_type is None:
            raise TypeError("opsmith.hf.patch: give a model, a model class or model_type=")
        _patch_module_names(_model_type_of(model_type), flags)
        return None
    if not inspect.isclass(model_or_class) and not isinstance(model_or_class, torch.nn.Module):
        raise TypeError(f"opsmith.hf.patch: expected a model, a model class or a model type, got "
                        f"{type(model_or_class).__name__}")
    if model_type is None:
        kind = _model_type_of(model_or_class)
    else:
        # any module holding this architecture's layers; a Hugging Face model
        # of another architecture is refused
        kind = _model_type_of(model_type)
        try:
            own = _model_type_of(model_or_class)
        except UnsupportedModelError:
            own = kind
        if own != kind:
            raise ValueError(f"opsmith.hf: patch_{kind} was given a {own} model; use patch_{own} or patch")
    if inspect.isclass(model_or_class):
        _patch_module_names(kind, flags)
        return model_or_class
    _patch_instance(model_or_class, kind, flags)
    return model_or_class


def _for(model_type: str):
    def patch_architecture(model_or_class=None, **options):
        return patch(model_or_class, model_type=model_type, **options)
    patch_architecture.__name__ = f"patch_{model_type}"
    patch_architecture.__doc__ = (f"opsmith.hf.patch for {model_type} models: a built model, its classes, or "
                                  f"(no argument) the architecture's classes.")
    return patch_architecture


patch_llama = _for("llama")
patch_mistral = _for("mistral")
patch_qwen2 = _for("qwen2")
patch_qwen3 = _for("qwen3")
patch_gemma = _for("gemma")
patch_gemma2 = _for("gemma2")

__all__ = ["patch", "patch_llama", "patch_mistral", "patch_qwen2", "patch_qwen3", "patch_gemma", "patch_gemma2",
           "causal_lm_loss", "fused_causal_lm_loss", "SUPPORTED", "UnsupportedModelError"]
