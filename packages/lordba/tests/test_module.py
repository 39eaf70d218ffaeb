"""LoRDBALinear: forward/backward against plain-torch formulas, kernels path, training."""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # for the kernels-path test, before triton loads

import pytest
import torch
from torch import nn

from loka.lordba import LoRDBAConfig, LoRDBALinear, convert_to_lordba
from loka.lordba.kernels import down as sign_down_module


def _ste_sign(latent, clip):
    """sign(latent) whose gradient is passed through where |latent| <= clip."""
    gate = (latent.abs() <= clip).float()
    return torch.where(latent < 0, -1.0, 1.0) + (latent - latent.detach()) * gate


def _reference_output(module, x):
    signs_a = _ste_sign(module.latent_a, module.clip_a)
    signs_b = _ste_sign(module.latent_b, module.clip_b)
    scaled = x if module.scale_in is None else x * module.scale_in
    rank = (scaled @ signs_a.T) * module.scale_rank
    return module.base(x) + module.scaling * module.scale_out * (rank @ signs_b.T)


def _trained_like(module, seed=0):
    """Give a fresh module nonzero output and latents spread around the STE clip."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.scale_out.copy_(torch.rand(module.out_features, generator=gen) + 0.5)
        module.scale_rank.copy_(torch.rand(module.config.rank, generator=gen) + 0.5)
        if module.scale_in is not None:
            module.scale_in.copy_(torch.rand(module.in_features, generator=gen) + 0.5)
        module.latent_a.mul_(4.0)  # some entries now beyond ste_clip * rms at init
    return module


@pytest.mark.parametrize("input_scale", [True, False])
def test_forward_and_gradients_match_plain_torch_ste(input_scale):
    torch.manual_seed(0)
    config = LoRDBAConfig(
        rank=4, input_scale=input_scale, scaling=0.5, ste_clip=2.0, backend="torch"
    )
    module = _trained_like(LoRDBALinear(nn.Linear(24, 18), config))
    x = torch.randn(2, 5, 24, requires_grad=True)
    out = module(x)
    expected = _reference_output(module, x)
    torch.testing.assert_close(out, expected)
    weights = torch.randn_like(out)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    inputs = [x] + [p for _, p in named]
    grads = torch.autograd.grad((out * weights).sum(), inputs, retain_graph=True)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    names = ["x"] + [n for n, _ in named]
    for name, grad, expected_grad in zip(names, grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, msg=name)
    assert all(p.grad is None and not p.requires_grad for p in module.base.parameters())
    gated = (module.latent_a.abs() > module.clip_a).sum()
    assert gated > 0  # the clipped estimator was exercised


def test_inference_uses_addmm_path_with_same_result():
    torch.manual_seed(1)
    module = _trained_like(LoRDBALinear(nn.Linear(20, 12), LoRDBAConfig(rank=3, backend="torch")))
    x = torch.randn(7, 20)
    module.requires_grad_(False)
    assert module._addmm_ok(x)
    torch.testing.assert_close(module(x), module.base(x) + x @ module.delta_weight().T)


class _OpaqueLinear(nn.Module):
    """A base that is not an nn.Linear (as an FP8 linear would be): only its shape is known."""

    def __init__(self, linear):
        super().__init__()
        self.inner = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x):
        return self.inner(x) * 2.0


def _tensor_devices(module):
    return {t.device for t in [*module.parameters(), *module.buffers()]}


def test_pluggable_base_module_moved_with_to():
    torch.manual_seed(2)
    module = _trained_like(
        LoRDBALinear(_OpaqueLinear(nn.Linear(16, 8)), LoRDBAConfig(rank=2, backend="torch"))
    )
    x = torch.randn(4, 16)
    with torch.no_grad():  # also fills the packed-signs cache on the CPU
        torch.testing.assert_close(module(x), module.base(x) + x @ module.delta_weight().T)
    # .to() moves base, adapter and (through the cache key) the packed signs together.
    meta = torch.device("meta")
    module.to(meta)
    assert _tensor_devices(module) == {meta}
    assert {t.device for t in module.packed_signs()} == {meta}
    assert module(x.to(meta)).device == meta
    with pytest.raises(ValueError, match=r"input is on cpu, the adapter on meta; move the module"):
        module(x)


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(sign_down_module._sign_down_kernel, InterpretedFunction)


@pytest.mark.skipif(
    not (_interpreted() or torch.cuda.is_available()),
    reason="loka.lordba.kernels was imported before TRITON_INTERPRET=1 was set and there is no GPU",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_path_matches_torch_path(dtype):
    torch.manual_seed(3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = nn.Linear(40, 36).to(device=device, dtype=dtype)
    results = []
    for backend in ("torch", "triton"):
        torch.manual_seed(4)
        config = LoRDBAConfig(rank=5, ste_clip=2.0, scaling=0.7, backend=backend)
        module = _trained_like(LoRDBALinear(base, config))
        x = torch.randn(3, 11, 40, device=device, dtype=dtype, requires_grad=True)
        out = module(x)
        out.float().square().sum().backward()
        results.append([out, x.grad, *(p.grad for p in module.parameters() if p.requires_grad)])
    tolerance = (
        {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    )
    for torch_value, triton_value in zip(*results, strict=True):
        scale = torch_value.float().abs().max().clamp_min(1.0)
        torch.testing.assert_close(
            triton_value.float() / scale, torch_value.float() / scale, **tolerance
        )


def test_bad_inputs_are_named():
    module = LoRDBALinear(nn.Linear(8, 4), LoRDBAConfig(rank=2, backend="torch"))
    with pytest.raises(ValueError, match=r"expects inputs \[\.\.\., 8\]"):
        module(torch.randn(3, 7))
    with pytest.raises(TypeError, match="floating-point input"):
        module(torch.ones(3, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="do not fit a base"):
        LoRDBALinear.from_lora(nn.Linear(8, 4), torch.randn(2, 9), torch.randn(4, 2))
    with pytest.raises(ValueError, match="rank mismatch"):
        LoRDBALinear.from_lora(nn.Linear(8, 4), torch.randn(2, 8), torch.randn(4, 3))
    with pytest.raises(ValueError, match="rank must be a positive int"):
        LoRDBAConfig(rank=0)
    with pytest.raises(ValueError, match="backend must be"):
        LoRDBAConfig(backend="cuda")
    with pytest.raises(TypeError, match="cannot tell the shape"):
        LoRDBALinear(nn.ReLU())


@pytest.mark.parametrize("input_scale", [False, True])
def test_from_lora_folds_scaling_and_matches_dense_update(input_scale):
    # Magnitudes each placement represents exactly: rank one with q, constant rows without.
    gen = torch.Generator().manual_seed(5)
    signs = torch.randint(0, 2, (3, 10), generator=gen) * 2.0 - 1.0
    columns = torch.rand(10, generator=gen) + 0.5 if input_scale else torch.ones(10)
    lora_a = signs * torch.outer(torch.rand(3, generator=gen) + 0.5, columns)
    lora_b = torch.outer(torch.rand(6, generator=gen) + 0.5, torch.rand(3, generator=gen) + 0.5)
    config = LoRDBAConfig(rank=3, input_scale=input_scale, backend="torch")
    module, fit = LoRDBALinear.from_lora(nn.Linear(10, 6), lora_a, lora_b, 4.0, config)
    assert (module.scale_in is not None) == input_scale
    assert module.scaling == 1.0 and fit.reconstruction_error < 1e-6
    torch.testing.assert_close(module.delta_weight(), 4.0 * lora_b @ lora_a)


def test_the_default_adapter_has_no_input_scale():
    module = LoRDBALinear(nn.Linear(10, 6))
    assert module.scale_in is None and not module.config.input_scale
    _, fit = LoRDBALinear.from_lora(nn.Linear(10, 6), torch.randn(2, 10), torch.randn(6, 2))
    assert fit.scale_in is None


def test_the_adapter_is_created_on_the_device_of_an_opaque_base():
    # The meta device stands in for a GPU on a CPU-only machine: a tensor left on the CPU
    # shows up as a second device (the H200 run hit that with a base without ``weight``).
    meta = torch.device("meta")
    module = LoRDBALinear(
        _OpaqueLinear(nn.Linear(16, 8, device=meta)), LoRDBAConfig(rank=2, input_scale=True)
    )
    assert _tensor_devices(module) == {meta}
    assert {t.device for t in module.packed_signs()} == {meta}
    assert module(torch.randn(3, 16, device=meta)).shape == (3, 8)
    # A base whose only tensor is a buffer, as a quantized linear's weight may be.
    buffered = _OpaqueLinear(nn.Linear(16, 8, device=meta))
    buffered.register_buffer("quantized_weight", buffered.inner.weight.detach())
    del buffered.inner
    assert _tensor_devices(LoRDBALinear(buffered)) == {meta}


def test_a_base_spread_over_devices_is_refused():
    base = _OpaqueLinear(nn.Linear(16, 8))
    base.register_buffer("stray", torch.zeros(1, device="meta"))
    with pytest.raises(ValueError, match=r"tensors on several devices \['cpu', 'meta'\]"):
        LoRDBALinear(base)


def test_convert_to_lordba_wraps_chosen_linears_with_zero_output():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    expected = model(x)
    converted = convert_to_lordba(
        model, LoRDBAConfig(rank=2, backend="torch"), lambda module, name: name == "2"
    )
    assert isinstance(converted[2], LoRDBALinear) and isinstance(converted[0], nn.Linear)
    torch.testing.assert_close(converted(x), expected)  # p = 0 at initialization
    trainable = {n for n, p in converted.named_parameters() if p.requires_grad}
    adapter = {f"2.{n}" for n in ("latent_a", "latent_b", "scale_rank", "scale_out")}
    assert trainable == adapter | {"0.weight", "0.bias"}  # only the wrapped base is frozen
    with pytest.raises(ValueError, match=r"no nn\.Linear module matched"):
        convert_to_lordba(nn.Sequential(nn.ReLU()))


@pytest.fixture
def one_thread():
    """Tiny CPU matmuls: a second intra-op thread only adds contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(
    adapter_kind, target, steps, rank, seed=0, in_features=32, out_features=32, input_scale=False
):
    gen = torch.Generator().manual_seed(seed)
    base = nn.Linear(in_features, out_features)
    torch.manual_seed(seed)
    if adapter_kind == "lora":
        bound = 1 / math.sqrt(in_features)
        lora_a = nn.Parameter(torch.empty(rank, in_features).uniform_(-bound, bound))
        lora_b = nn.Parameter(torch.zeros(out_features, rank))
        params, model = [lora_a, lora_b], lambda x: base(x) + x @ lora_a.T @ lora_b.T
    else:
        config = LoRDBAConfig(rank=rank, input_scale=input_scale, backend="torch")
        model = LoRDBALinear(base, config)
        params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, in_features, generator=gen)
        with torch.no_grad():
            y = base(x) + x @ target.T
        loss = (model(x) - y).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], sum(losses[-20:]) / 20


@pytest.mark.parametrize("input_scale", [False, True])
def test_training_reduces_loss_like_lora_on_a_sign_structured_update(one_thread, input_scale):
    # Target update drawn at rank 4 from the adapter's own family (with q: a per-input-channel
    # profile; any rank-4 LoRA can express either).
    gen = torch.Generator().manual_seed(7)
    k = n = 32
    signs_a = torch.randint(0, 2, (4, k), generator=gen) * 2.0 - 1.0
    signs_b = torch.randint(0, 2, (n, 4), generator=gen) * 2.0 - 1.0
    scales = [torch.rand(size, generator=gen) + 0.5 for size in (n, 4, k)]
    profile = scales[2] if input_scale else torch.ones(k)
    target = (scales[0][:, None] * signs_b * scales[1]) @ (signs_a * profile) / math.sqrt(k)
    lora_first, lora_last = _train("lora", target, steps=300, rank=8)
    lordba_first, lordba_last = _train("lordba", target, 300, 8, input_scale=input_scale)
    assert lora_last < 1e-2 * lora_first
    assert lordba_last < 1e-2 * lordba_first


def test_training_reduces_loss_on_a_generic_low_rank_update(one_thread):
    # A Gaussian rank-4 update has no exact sign form: LoRDBA gets most, not all, of the way.
    gen = torch.Generator().manual_seed(8)
    target = torch.randn(32, 4, generator=gen) @ torch.randn(4, 32, generator=gen) / math.sqrt(32)
    lora_first, lora_last = _train("lora", target, steps=300, rank=8)
    lordba_first, lordba_last = _train("lordba", target, steps=300, rank=8)
    assert lora_last < 1e-2 * lora_first
    assert lordba_last < 0.4 * lordba_first
