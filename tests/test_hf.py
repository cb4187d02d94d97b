"""opsmith.hf: Hugging Face models patched onto opsmith's kernels match the
unpatched models (logits, loss, every parameter's gradient, 20 training
steps), for every supported architecture, built from tiny random configs
(nothing downloaded)."""
import copy
import gc
import importlib
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

import opsmith  # noqa: E402
import opsmith.hf as hf  # noqa: E402
from conftest import devices  # noqa: E402

DEVICES = devices  # the CUDA entry skips (and is counted) without a GPU


def tiny_config(model_type):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  attn_implementation="eager")
    if model_type in ("gemma", "gemma2", "qwen3"):
        common["head_dim"] = 16
    if model_type == "gemma2":
        common.update(sliding_window=16, final_logit_softcapping=None)
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(**{k: v for k, v in common.items() if k != "attn_implementation"})
    config._attn_implementation = "eager"
    return config


def build(model_type, dtype, device, seed=0):
    torch.manual_seed(seed)
    module, _, _, causal_cls, _ = hf._classes(model_type)
    model = causal_cls(tiny_config(model_type)).to(device=device, dtype=dtype)
    # Gemma's norms start at weight 0 and Llama's at 1: move them off their
    # initial values so a wrong offset or a dropped weight shows
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture
def restore_modeling():
    """Class patching replaces module-level names: put them back afterwards."""
    saved = []
    for model_type, entry in hf.SUPPORTED.items():
        module = importlib.import_module(entry[0])
        causal_cls = getattr(module, entry[3])
        saved.append((module, dict(vars(module)), causal_cls, dict(causal_cls.__dict__)))
    yield
    for module, names, causal_cls, attrs in saved:
        for key, value in names.items():
            if getattr(module, key, None) is not value:
                setattr(module, key, value)
        for key in ("_loss_function", "forward", "_opsmith_fused_loss"):
            if key in attrs:
                setattr(causal_cls, key, attrs[key])
            elif key in causal_cls.__dict__:
                delattr(causal_cls, key)


def batch(model, device, seed=1, rows=2, seq=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), generator=g).to(device)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def forward_backward(model, ids, labels):
    """(logits, loss, grads): the loss and gradients from a training
    forward (a patched model's goes through fused linear cross-entropy and
    makes no logits), the logits from a forward without grad."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return logits, out.loss.detach(), grads


def assert_same_training(kept, recomputed, ids, labels, rtol, atol):
    """A patched model that makes a tensor again in the backward trains as the
    one that keeps it: the same loss, every gradient nonzero and within
    rtol/atol."""
    _, loss_k, grads_k = forward_backward(kept, ids, labels)
    _, loss_r, grads_r = forward_backward(recomputed, ids, labels)
    torch.testing.assert_close(loss_r, loss_k, rtol=0, atol=0)
    assert grads_r.keys() == grads_k.keys()
    for name in grads_k:
        assert grads_r[name].abs().sum() > 0, name
        torch.testing.assert_close(grads_r[name], grads_k[name], rtol=rtol, atol=atol, msg=name)


def patched_count(model):
    return sum(1 for m in model.modules() if getattr(type(m), "_opsmith_patched", False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", sorted(hf.SUPPORTED))
def test_patched_instance_matches_float32(model_type, device, restore_modeling):
    ref = build(model_type, torch.float32, device)
    model = copy.deepcopy(ref)
    assert hf.patch(model) is model
    # every norm and every MLP of the model computes through opsmith, every
    # decoder layer makes its norms' outputs again in the backward, and the
    # causal LM's own forward (the fused linear cross-entropy loss)
    layers = model.config.num_hidden_layers
    norms_per_layer = {"gemma2": 4, "qwen3": 4}.get(model_type, 2)
    assert patched_count(model) == layers * (norms_per_layer + 2) + 1 + 1
    assert isinstance(model.model.norm, hf._classes(model_type)[1])  # still the Hugging Face class
    assert model.state_dict().keys() == ref.state_dict().keys()
    # rotary and the loss go through opsmith too (this build has both)
    assert hf._classes(model_type)[0].apply_rotary_pos_emb is opsmith.apply_rotary_pos_emb
    assert model.loss_function is hf.causal_lm_loss
    ids, labels = batch(model, device)
    # training with labels: the loss through fused linear cross-entropy, no logits made
    assert model.training and model(input_ids=ids, labels=labels).logits is None
    assert model(input_ids=ids, labels=labels, skip_logits=False).logits is not None
    assert ref(input_ids=ids, labels=labels).logits is not None
    logits_r, loss_r, grads_r = forward_backward(ref, ids, labels)
    logits, loss, grads = forward_backward(model, ids, labels)
    torch.testing.assert_close(logits, logits_r, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(loss, loss_r, rtol=2e-5, atol=2e-5)
    assert grads.keys() == grads_r.keys() and len(grads) == len(list(model.parameters()))
    for name in grads:
        assert grads[name].abs().sum() > 0, name
        torch.testing.assert_close(grads[name], grads_r[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_patched_bf16_matches_within_bf16(model_type, device, restore_modeling):
    """bf16 models with the architecture's own casting (Llama rounds x_hat to
    bf16 before the weight; Gemma stays in float32): the patched model's
    logits and loss agree with the unpatched one's to bf16 rounding."""
    ref = build(model_type, torch.bfloat16, device)
    model = hf.patch(copy.deepcopy(ref))
    ids, labels = batch(model, device)
    logits_r, loss_r, grads_r = forward_backward(ref, ids, labels)
    logits, loss, grads = forward_backward(model, ids, labels)
    assert logits.dtype == logits_r.dtype
    scale = logits_r.float().abs().max()
    assert (logits.float() - logits_r.float()).abs().max() <= 0.02 * scale
    assert abs(loss.item() - loss_r.item()) <= 0.01 * abs(loss_r.item())
    for name in grads_r:
        g, r = grads[name].float(), grads_r[name].float()
        assert (g - r).norm() <= 0.05 * r.norm() + 1e-6, name


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2"])
def test_twenty_training_steps_track(model_type, restore_modeling):
    ref = build(model_type, torch.float32, "cpu")
    model = hf.patch(copy.deepcopy(ref))
    opt_r = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses_r, losses = [], []
    for step in range(20):
        ids, labels = batch(model, "cpu", seed=100 + step % 2)  # two batches: it can learn them
        for m, o, out in ((ref, opt_r, losses_r), (model, opt, losses)):
            o.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            o.step()
            out.append(loss.item())
    assert losses[-1] < losses[0]  # it trains
    for a, b in zip(losses, losses_r):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b))


def test_class_patch_before_building(restore_modeling):
    """Patching the classes first: every model built afterwards uses opsmith
    from the start, with the weights Hugging Face initialises."""
    ref = build("qwen3", torch.float32, "cpu")
    hf.patch_qwen3()
    model = build("qwen3", torch.float32, "cpu")
    assert patched_count(model) == 2 * 6 + 1  # a layer: 4 norms, the MLP, the layer; the final norm
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n
    ids, labels = batch(model, "cpu")
    logits, loss, grads = forward_backward(model, ids, labels)
    logits_r, loss_r, grads_r = forward_backward(ref, ids, labels)
    torch.testing.assert_close(logits, logits_r, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(loss, loss_r, rtol=2e-5, atol=2e-5)
    for name in grads_r:
        torch.testing.assert_close(grads[name], grads_r[name], rtol=1e-4, atol=1e-5, msg=name)
    # the class's own forward takes the loss through fused linear cross-entropy
    assert model(input_ids=ids, labels=labels).logits is None
    # patching a class object works the same way, and twice is harmless
    module, norm_cls, mlp_cls, causal_cls, _ = hf._classes("llama")
    assert hf.patch(causal_cls) is causal_cls
    hf.patch(causal_cls)
    assert getattr(module, norm_cls.__name__)._opsmith_patched
    assert getattr(module, mlp_cls.__name__).__mro__[1] is mlp_cls


def test_patching_twice_and_flags(restore_modeling):
    ref = build("llama", torch.float32, "cpu")
    model = hf.patch(hf.patch(copy.deepcopy(ref), glu=False))
    assert patched_count(model) == 2 * 4 + 1 + 1  # the second call added the MLPs (+1: the causal LM)
    only_norms = hf.patch(copy.deepcopy(ref), glu=False, fused_linear_cross_entropy=False)
    assert patched_count(only_norms) == 2 * 3 + 1  # norms and layers
    assert only_norms(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).logits \
        is not None  # the unfused loss path keeps its logits


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled_layers"])
@pytest.mark.parametrize("device", DEVICES)
def test_glu_recompute_keeps_no_mlp_product(device, compiled, restore_modeling):
    """Training, the patched MLP keeps no act(gate) * up for down_proj
    (glu_recompute, the default): exactly one [tokens, intermediate] tensor an
    MLP fewer saved for the backward, the same loss and gradients, with the
    decoder layers compiled too (as the README advises); a hooked down_proj is
    still called."""
    from opsmith.bench import saved_tensor_bytes
    ref = build("llama", torch.float32, device)
    kept = hf.patch(copy.deepcopy(ref), glu_recompute=False)
    recomputed = hf.patch(copy.deepcopy(ref))
    if compiled:
        for model in (kept, recomputed):
            for layer in model.model.layers:
                layer.compile(backend="aot_eager")
    ids, labels = batch(ref, device)
    out_k, bytes_k = saved_tensor_bytes(lambda: kept(input_ids=ids, labels=labels))
    out_r, bytes_r = saved_tensor_bytes(lambda: recomputed(input_ids=ids, labels=labels))
    cfg = ref.config
    assert bytes_k - bytes_r == cfg.num_hidden_layers * ids.numel() * cfg.intermediate_size * 4
    assert_same_training(kept, recomputed, ids, labels, rtol=1e-6, atol=1e-7)
    if compiled:
        return
    calls = []
    recomputed.model.layers[0].mlp.down_proj.register_forward_hook(lambda *a: calls.append(1))
    recomputed(input_ids=ids, labels=labels).loss.backward()
    assert calls == [1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3"])
def test_norm_recompute_keeps_no_norm_output(model_type, device, restore_modeling):
    """Training, no norm output is kept alive by the graph (norm_recompute,
    the default): q/k/v_proj and gate/up_proj keep the norm's input instead
    and the backward makes the output again, bit for bit: the same loss and
    gradients as keeping it. Under other saved-tensor hooks the layers keep
    it as usual."""
    ref = build(model_type, torch.float32, device)
    kept = hf.patch(copy.deepcopy(ref), norm_recompute=False)
    recomputed = hf.patch(copy.deepcopy(ref))
    ids, labels = batch(ref, device)

    def alive_norm_outputs(model, hooks=None):
        outputs = []
        handles = [m.register_forward_hook(lambda m, i, o: outputs.append(weakref.ref(o)))
                   for name, m in model.named_modules() if name.startswith("model.layers.") and "layernorm" in name]
        if hooks is None:
            loss = model(input_ids=ids, labels=labels).loss
        else:
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                loss = model(input_ids=ids, labels=labels).loss
        for h in handles:
            h.remove()
        gc.collect()
        alive = sum(ref() is not None for ref in outputs)
        loss.backward()
        return len(outputs), alive

    norms = sum(1 for name, _ in ref.named_modules() if name.startswith("model.layers.") and "layernorm" in name)
    assert norms >= 2 * ref.config.num_hidden_layers
    total, alive = alive_norm_outputs(kept)
    assert total == norms and alive >= 2 * ref.config.num_hidden_layers  # what q/k/v and gate/up keep
    assert alive_norm_outputs(recomputed) == (norms, 0)
    assert alive_norm_outputs(recomputed, (lambda t: t, lambda t: t)) == (norms, alive)
    assert_same_training(kept, recomputed, ids, labels, rtol=0, atol=0)  # the same bits


def test_norm_recompute_keeps_an_output_changed_in_place(restore_modeling):
    """A forward hook that scales the norm's output in place (activation
    steering): that output is saved as it is, not made again unscaled."""
    ref = build("llama", torch.float32, "cpu")
    models = [hf.patch(copy.deepcopy(ref), norm_recompute=flag) for flag in (False, True)]
    for model in models:
        for layer in model.model.layers:
            layer.input_layernorm.register_forward_hook(lambda m, i, o: o.mul_(3.0))
    ids, labels = batch(ref, "cpu")
    assert_same_training(*models, ids, labels, rtol=0, atol=0)


def test_norm_recompute_once_a_backward_with_retain_graph(restore_modeling):
    """A graph run backward twice (retain_graph): each backward makes each
    norm output again once for all its saved uses, and the second gives the
    first's gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NormForwards(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            NormForwards.count += func is torch.ops.opsmith.rms_norm_fwd.default
            return func(*args, **(kwargs or {}))

    model = hf.patch(build("llama", torch.float32, "cpu"))
    ids, labels = batch(model, "cpu")
    params = [p for p in model.parameters()]
    loss = model(input_ids=ids, labels=labels).loss
    counts, grads = [], []
    for _ in range(2):
        NormForwards.count = 0
        with NormForwards():
            grads.append(torch.autograd.grad(loss, params, retain_graph=True))
        counts.append(NormForwards.count)
    layers = model.config.num_hidden_layers
    assert counts == [2 * layers, 2 * layers]  # input and post-attention norms, once each
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_norm_recompute_under_torch_func_grad(restore_modeling):
    """torch.func transforms disable saved-tensor hooks: the layers take the
    usual path there, and the gradients are the unpatched model's."""
    ref = build("llama", torch.float32, "cpu")
    model = hf.patch(copy.deepcopy(ref), glu=False, fused_linear_cross_entropy=False)
    ids, labels = batch(ref, "cpu")
    params = dict(model.named_parameters())

    def loss_of(p, m):
        return torch.func.functional_call(m, p, (), {"input_ids": ids, "labels": labels}).loss

    grads = torch.func.grad(loss_of)(params, model)
    want = torch.func.grad(loss_of)(dict(ref.named_parameters()), ref)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_norm_recompute_refuses_an_input_changed_in_place(restore_modeling):
    model = hf.patch(build("llama", torch.float32, "cpu"))
    ids, labels = batch(model, "cpu")
    weight = model.model.layers[0].input_layernorm.weight
    loss = model(input_ids=ids, labels=labels).loss
    with torch.no_grad():
        weight.mul_(2)
    with pytest.raises(RuntimeError, match="LlamaRMSNorm was modified in place"):
        loss.backward()


def test_flags_must_be_bools():
    model = build("llama", torch.float32, "cpu")
    with pytest.raises(TypeError, match="glu_recompute must be True or False, got 'yes'"):
        hf.patch(model, glu_recompute="yes")
    with pytest.raises(TypeError, match="rope must be True or False or None, got 1"):
        hf.patch(model, rope=1)
    with pytest.raises(TypeError, match="rms_norm must be True or False, got None"):
        hf.patch(model, rms_norm=None)
    assert patched_count(model) == 0  # refused before anything was patched


def test_unsupported_model_type_names_the_supported_ones():
    config = transformers.AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                               bos_token_id=0, eos_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(hf.UnsupportedModelError, match="gpt2.*supported: gemma, gemma2, llama, mistral, qwen2, qwen3"):
        hf.patch(model)
    with pytest.raises(hf.UnsupportedModelError, match="supported"):
        hf.patch(model_type="bert")
    with pytest.raises(ValueError, match="patch_gemma was given a llama model"):
        hf.patch_gemma(build("llama", torch.float32, "cpu"))
    with pytest.raises(TypeError, match="expected a model"):
        hf.patch(42)


def test_unknown_activation_is_left_alone(restore_modeling):
    model = build("llama", torch.float32, "cpu")
    model.model.layers[0].mlp.act_fn = torch.nn.ReLU()
    hf.patch(model)
    assert not getattr(type(model.model.layers[0].mlp), "_opsmith_patched", False)
    assert getattr(type(model.model.layers[1].mlp), "_opsmith_patched", False)


def test_patched_model_trains_under_compile(restore_modeling):
    model = hf.patch(build("llama", torch.float32, "cpu"))
    ref = build("llama", torch.float32, "cpu")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
    ids, labels = batch(model, "cpu")
    loss = compiled(input_ids=ids, labels=labels).loss
    loss.backward()
    loss_r = ref(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, loss_r, rtol=2e-5, atol=2e-5)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("model_type", sorted(hf.SUPPORTED))
def test_patched_norm_rounds_as_the_architecture(model_type, weight_dtype, device, restore_modeling):
    """bf16 activations with bf16 or float32 norm weights (as under autocast):
    the patched norm rounds where the architecture's own does (Llama: x_hat
    to bf16, then the weight multiply in the promoted dtype; Gemma: float32
    throughout), so the outputs agree bit for bit but for the rare element
    where a sum order moves the last bit, and have the same dtype."""
    norm_cls = hf._classes(model_type)[1]
    ref = norm_cls(256, eps=1e-6).to(device=device, dtype=weight_dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(256) * 0.5)
    norm = copy.deepcopy(ref)
    hf.patch(torch.nn.Sequential(norm), model_type=model_type)
    assert type(norm)._opsmith_patched
    x = torch.randn(8, 16, 256, device=device).mul(3).to(torch.bfloat16)
    y, r = norm(x), ref(x)
    assert y.dtype == r.dtype
    assert (y == r).float().mean() >= 0.999
    torch.testing.assert_close(y, r)


class _ScaledHead(torch.nn.Linear):
    """An lm_head subclass with its own forward (as an adapter has)."""

    def __init__(self, head):
        super().__init__(head.in_features, head.out_features, bias=head.bias is not None)
        self.weight = head.weight
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return super().forward(x) * self.scale


@pytest.mark.parametrize("change", ["hook", "subclass"])
def test_lm_head_with_its_own_forward_is_called(change, restore_modeling):
    """An lm_head with a forward hook or of a Linear subclass (an adapter)
    computes through its own forward when training with labels, as
    unpatched: the fused loss path, which reads the weight alone, would drop
    what the forward adds (and the adapter's parameters would get no
    gradient)."""
    ref = build("llama", torch.float32, "cpu")
    model = hf.patch(copy.deepcopy(ref))
    for m in (ref, model):
        if change == "hook":
            m.lm_head.register_forward_hook(lambda mod, args, out: out * 0.5)
        else:
            m.lm_head = _ScaledHead(m.lm_head)
    ids, labels = batch(model, "cpu")
    losses = []
    for m in (ref, model):
        m.train()
        out = m(input_ids=ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-5, atol=2e-5)
    if change == "subclass":
        assert model.lm_head.scale.grad is not None
        torch.testing.assert_close(model.lm_head.scale.grad, ref.lm_head.scale.grad, rtol=1e-4, atol=1e-6)
    # asked for no logits: the loss alone still
    out = model(input_ids=ids, labels=labels, skip_logits=True)
    assert out.logits is None
    torch.testing.assert_close(out.loss, losses[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind", ["backward", "backward_pre", "global_backward"])
def test_module_backward_hooks_fire_as_unpatched(kind, restore_modeling):
    """Backward hooks on lm_head, down_proj and the MLP's activation (each
    module's own, or a global one) fire when training with labels as in the
    unpatched model, and a hook that changes the gradient it is given changes
    the parameters' gradients alike: the fused paths, which skip those
    modules' calls, are not taken for a hooked module."""
    ref = build("llama", torch.float32, "cpu")
    model = hf.patch(copy.deepcopy(ref))
    ids, labels = batch(model, "cpu")
    fired = {}

    def hook(tag):
        def fn(mod, *grads):
            fired[tag].append(type(mod).__name__)
            if kind != "global_backward" and type(mod).__name__ != "Linear":
                # the activation's hook halves the gradient that reaches gate_proj
                return (grads[-1][0] * 0.5,) + tuple(grads[-1][1:])
        return fn

    handles = []
    for tag, m in (("ref", ref), ("patched", model)):
        fired[tag] = []
        mlp = m.model.layers[0].mlp
        if kind == "global_backward":
            handles.append(torch.nn.modules.module.register_module_full_backward_hook(hook(tag)))
        else:
            for mod in (m.lm_head, mlp.down_proj, mlp.act_fn):
                reg = mod.register_full_backward_hook if kind == "backward" else mod.register_full_backward_pre_hook
                handles.append(reg(hook(tag)))
        m.train()
        m(input_ids=ids, labels=labels).loss.backward()
        for h in handles:
            h.remove()
        handles.clear()
    assert sorted(fired["patched"]) == sorted(fired["ref"]) and fired["ref"], fired
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_logits_to_keep_as_hugging_face(restore_modeling):
    """logits_to_keep as Hugging Face takes it: an int, 1-D positions, and
    where the installed transformers takes them, 2-D positions per sample and
    a 2-D boolean mask."""
    ref = build("llama", torch.float32, "cpu").eval()
    model = hf.patch(copy.deepcopy(ref)).eval()
    ids, _ = batch(model, "cpu")
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[0, 2], mask[1, 5:8] = True, True
    keeps = [0, 3, torch.tensor([1, 4])]
    import transformers.modeling_utils as modeling_utils
    if hasattr(modeling_utils, "slice_logits_to_keep"):  # 2-D forms: transformers 5.23 has them, 5.17 not
        keeps += [torch.tensor([[0, 4], [3, 9]]), mask]
    for keep in keeps:
        with torch.no_grad():
            want = ref(input_ids=ids, logits_to_keep=keep).logits
            got = model(input_ids=ids, logits_to_keep=keep).logits
        assert got.shape == want.shape, keep
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_logits_loss_is_float32_as_hugging_face(device):
    """The loss from bf16 logits (evaluation, or logits asked for) is
    float32 and unrounded, as Hugging Face's ForCausalLMLoss gives it (it
    upcasts the logits): equal within float32, with and without
    num_items_in_batch, where a loss rounded to bf16 is off by ~1e-2."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 33, 301, generator=g) * 3).to(torch.bfloat16).to(device)
    labels = torch.randint(0, 301, (2, 33), generator=g).to(device)
    labels[0, :5] = -100
    for kw in ({}, {"num_items_in_batch": torch.tensor(50)}):
        want = ForCausalLMLoss(logits, labels, 301, **kw)
        got = hf.causal_lm_loss(logits, labels, 301, **kw)
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    # float64 logits: Hugging Face's .float() gives float32 there too
    assert hf.causal_lm_loss(logits.double(), labels, 301).dtype == ForCausalLMLoss(logits.double(), labels, 301).dtype


def test_fused_loss_softcap_and_num_items(restore_modeling):
    """Gemma 2's final logit softcapping and Hugging Face's
    num_items_in_batch (gradient accumulation) through the fused loss path:
    loss and every gradient as the unpatched model gives them."""
    torch.manual_seed(0)
    config = tiny_config("gemma2")
    config.final_logit_softcapping = 3.0
    _, _, _, causal_cls, _ = hf._classes("gemma2")
    ref = causal_cls(config)
    model = hf.patch(copy.deepcopy(ref))
    ids, labels = batch(model, "cpu")
    for kw in ({}, {"num_items_in_batch": torch.tensor(7)}):
        outs = []
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
            out = m(input_ids=ids, labels=labels, **kw)
            out.loss.backward()
            outs.append((out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
        (out_r, grads_r), (out, grads) = outs
        assert out.logits is None and out_r.logits is not None
        torch.testing.assert_close(out.loss, out_r.loss.float(), rtol=2e-5, atol=2e-5)
        assert grads.keys() == grads_r.keys()
        for name in grads_r:
            torch.testing.assert_close(grads[name], grads_r[name], rtol=1e-4, atol=1e-5, msg=name)
    # evaluation: logits as Hugging Face makes them, capped
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, labels=labels).logits
    assert logits is not None and logits.abs().max() <= 3.0


def _module_options(model):
    return [(name, type(m).__name__, getattr(m, "_opsmith_glu_recompute", None),
             getattr(m, "_opsmith_norm_recompute", None)) for name, m in model.named_modules()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", sorted(hf.SUPPORTED))
def test_patched_model_pickles_whole(model_type, device, restore_modeling, tmp_path):
    """torch.save(model) of a patched model (its classes made at run time)
    loads back patched, with its recompute options, computing the same loss
    and gradients; in a process that never patched too (a subprocess loads
    the file and compares the logits)."""
    ref = build(model_type, torch.float32, device)
    model = hf.patch(copy.deepcopy(ref), glu_recompute=False, norm_recompute=True)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    back = torch.load(path, weights_only=False)
    assert patched_count(back) == patched_count(model) > 0
    assert _module_options(back) == _module_options(model)
    ids, labels = batch(model, device)
    logits, loss, grads = forward_backward(model, ids, labels)
    logits_b, loss_b, grads_b = forward_backward(back, ids, labels)
    assert torch.equal(logits_b, logits) and torch.equal(loss_b, loss)
    assert grads_b.keys() == grads.keys()
    for name in grads:
        assert torch.equal(grads_b[name], grads[name]), name
    if model_type != "llama" or device != "cpu":
        return
    torch.save((ids, logits), tmp_path / "expected.pt")
    code = ("import sys, torch\n"
            "m = torch.load(sys.argv[1], weights_only=False)\n"
            "ids, logits = torch.load(sys.argv[2])\n"
            "assert sum(1 for x in m.modules() if getattr(type(x), '_opsmith_patched', False)) > 0\n"
            "assert 'opsmith.hf' in sys.modules  # loading imported it: nothing was patched by hand\n"
            "with torch.no_grad():  # rotary is Hugging Face's here (a module-level patch is not carried)\n"
            "    torch.testing.assert_close(m(input_ids=ids).logits, logits, rtol=2e-5, atol=2e-5)\n")
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "expected.pt")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_class_patched_model_pickles(restore_modeling, tmp_path):
    """A model built after a class patch: its norms, MLPs and layers are the
    patched subclasses, and load back as such, the options the class patch
    set on the subclasses carried in the modules themselves (a process that
    never patched has them nowhere else); a model built before the patch
    (plain Hugging Face modules, whose module-level names the patch rebound)
    still pickles, as it was."""
    before = build("llama", torch.float32, "cpu")
    hf.patch_llama(norm_recompute=True, glu_recompute=False)
    model = build("llama", torch.float32, "cpu")
    torch.save(model, tmp_path / "model.pt")
    back = torch.load(tmp_path / "model.pt", weights_only=False)
    assert patched_count(back) == patched_count(model) > 0
    assert _module_options(back) == _module_options(model)
    layer = back.model.layers[0]
    assert vars(layer.mlp)["_opsmith_glu_recompute"] is False
    assert vars(layer)["_opsmith_norm_recompute"] is True
    ids, labels = batch(model, "cpu")
    assert torch.equal(forward_backward(back, ids, labels)[1], forward_backward(model, ids, labels)[1])
    torch.save(before, tmp_path / "before.pt")
    again = torch.load(tmp_path / "before.pt", weights_only=False)
    assert patched_count(again) == 0 and patched_count(copy.deepcopy(before)) == 0
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, before(input_ids=ids).logits)


def test_patching_again_sets_the_mlp_option(restore_modeling):
    model = hf.patch(build("llama", torch.float32, "cpu"), glu_recompute=True)
    hf.patch(model, glu_recompute=False)
    assert all(m._opsmith_glu_recompute is False for m in model.modules() if type(m).__name__ == "LlamaMLP")
