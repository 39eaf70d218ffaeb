"""Packed multi-LoRA: layer, per-adapter optimizer, checkpoints and the runner (CPU)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import json
import math

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from loka.plora import (
    LoraJobConfig,
    PackedLoraConfig,
    PerAdapterOptimizer,
    RunnerConfig,
    convert_to_packed_lora,
    load_adapter,
    save_adapter,
    train_packs,
)
from loka.plora.kernels import multi_lora_kernels_available
from loka.plora.runner import compiled_loss, packed_train_step, profile_pack, token_losses

VOCAB, SEQ = 61, 8
needs_kernels = pytest.mark.skipif(
    not multi_lora_kernels_available("cpu"),
    reason="loka.plora.kernels was imported without TRITON_INTERPRET=1 in this process",
)


def tiny_llama(seed: int = 0, vocab_size: int = VOCAB) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        eos_token_id=1,
        bos_token_id=1,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).float().eval()


def job(name, rank=4, alpha=8.0, lr=1e-2, batch_size=1, seed=0, **kw):
    return LoraJobConfig(
        name, rank, alpha, lr, batch_size, steps=kw.pop("steps", 2), seed=seed, **kw
    )


def batches_for(jobs, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (i, torch.randint(0, VOCAB, (j.batch_size, SEQ + 1), generator=g))
        for i, j in enumerate(jobs)
    ]


def params_of(packed, index):
    return [p.detach().clone() for p in packed.adapter_parameters(index)]


def randomize_b(packed, seed=5):
    # B starts at zero in LoRA, which makes dA and the adapter's output vanish; tests that
    # compare those give B random values.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in packed.modules.values():
            for b in module.lora_B:
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_kernels), "loop"])
def test_packed_layer_equals_per_adapter_loop_for_mixed_ranks(backend):
    torch.manual_seed(0)
    base = nn.Linear(24, 40)
    jobs = [job("a", rank=2, alpha=4), job("b", rank=8, alpha=8, seed=1), job("c", rank=5, alpha=1)]
    wrapper = nn.Sequential(base)
    packed = convert_to_packed_lora(
        wrapper, jobs, PackedLoraConfig(target_modules=("0",), backend=backend)
    )
    randomize_b(packed)
    layer = packed.modules["0"]
    counts = [3, 0, 2]  # adapter b has no sample in this batch
    packed.set_batch([0, 0, 0, 2, 2], tokens_per_sample=4)
    x = torch.randn(5, 4, 24, requires_grad=True)
    y = wrapper(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    # The same computation one adapter at a time, with fresh leaves.
    x_ref = x.detach().clone().requires_grad_()
    start = 0
    for i, (count, j) in enumerate(zip(counts, jobs, strict=True)):
        a = layer.lora_A[i].detach().clone().requires_grad_()
        b = layer.lora_B[i].detach().clone().requires_grad_()
        xi = x_ref[start : start + count]
        yi = base(xi) + j.scale * (xi @ a.t()) @ b.t()
        torch.testing.assert_close(y[start : start + count], yi, rtol=1e-4, atol=1e-5)
        if count:
            yi.backward(dy[start : start + count])
            grad_a, grad_bt = (p.grad for p in layer.adapter_parameters(i))
            torch.testing.assert_close(grad_a, a.grad, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(grad_bt, b.grad.t(), rtol=1e-4, atol=1e-5)
        else:
            for p in layer.adapter_parameters(i):
                assert p.grad is None or torch.all(p.grad == 0)
        start += count
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    assert not base.weight.requires_grad and base.weight.grad is None


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_kernels), "loop"])
def test_a_lone_adapter_runs_on_its_own_parameters_without_a_copy(backend):
    torch.manual_seed(0)
    base = nn.Linear(24, 40)
    wrapper = nn.Sequential(base)
    packed = convert_to_packed_lora(
        wrapper,
        [job("a", rank=4, alpha=8)],
        PackedLoraConfig(target_modules=("0",), backend=backend),
    )
    randomize_b(packed)
    layer = packed.modules["0"]
    a_cat, b_cat = layer._packed_factors(torch.float32)
    assert a_cat is layer.lora_packed_A  # no concatenation copy
    assert b_cat.data_ptr() == layer.lora_packed_Bt.data_ptr() and b_cat.shape == (40, 4)
    assert layer._packed_factors(torch.bfloat16)[0].dtype == torch.bfloat16
    packed.set_batch([0, 0], tokens_per_sample=3)
    x = torch.randn(2, 3, 24)
    y = wrapper(x)
    y.backward(torch.ones_like(y))
    a = layer.lora_A[0].detach().clone().requires_grad_()
    b = layer.lora_B[0].detach().clone().requires_grad_()
    y_ref = base(x) + layer.scales[0] * (x @ a.t()) @ b.t()
    y_ref.backward(torch.ones_like(y_ref))
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.lora_packed_A.grad, a.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.lora_packed_Bt.grad, b.grad.t(), rtol=1e-4, atol=1e-5)


def test_per_adapter_learning_rates_differ_in_effect_and_match_solo_training():
    jobs = [job("slow", lr=1e-3, seed=3), job("fast", lr=1e-2, seed=3)]
    model = tiny_llama()
    packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend="loop"))
    before = [params_of(packed, i) for i in range(2)]
    opt = PerAdapterOptimizer(packed)
    # Identical data for both jobs: only the learning rate differs.
    ids = torch.randint(0, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(1))
    packed_train_step(packed, opt, [(0, ids), (1, ids)])
    deltas = []
    for i in range(2):
        after = params_of(packed, i)
        deltas.append(sum((a - b).abs().sum() for a, b in zip(after, before[i], strict=True)))
    # AdamW's first step moves every parameter with a gradient by about lr.
    assert 8.0 < float(deltas[1] / deltas[0]) < 12.0
    packed_fast = params_of(packed, 1)
    packed.remove()

    solo = convert_to_packed_lora(model, [jobs[1]], PackedLoraConfig(backend="loop"))
    solo_opt = PerAdapterOptimizer(solo)
    packed_train_step(solo, solo_opt, [(0, ids)])
    for got, want in zip(packed_fast, params_of(solo, 0), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    solo.remove()


@needs_kernels
def test_triton_backend_trains_like_loop_backend_on_a_causal_lm():
    jobs = [job("a", rank=4, batch_size=2), job("b", rank=8, alpha=4, seed=1, lr=3e-3)]
    results = []
    for backend in ("triton", "loop"):
        model = tiny_llama()
        packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend=backend))
        randomize_b(packed)
        opt = PerAdapterOptimizer(packed)
        losses, _ = packed_train_step(packed, opt, batches_for(jobs))
        results.append((losses, [params_of(packed, i) for i in range(2)]))
        packed.remove()
    (loss_t, params_t), (loss_l, params_l) = results
    assert loss_t == pytest.approx(loss_l, rel=1e-5)
    for got_list, want_list in zip(params_t, params_l, strict=True):
        for got, want in zip(got_list, want_list, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_adapter_id_out_of_range_is_refused_and_changes_nothing():
    jobs = [job("a"), job("b", seed=1)]
    model = tiny_llama()
    packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend="loop"))
    layout = packed.set_batch([0, 1], SEQ)
    with pytest.raises(ValueError, match=r"adapter id 2 \(sample 1\) is out of range for 2"):
        packed.set_batch([0, 2], SEQ)
    with pytest.raises(ValueError, match="not consecutive"):
        packed.set_batch([0, 1, 0], SEQ)
    with pytest.raises(ValueError, match="out of range"):
        packed_train_step(
            packed,
            PerAdapterOptimizer(packed),
            [(0, batches_for(jobs)[0][1]), (5, batches_for(jobs)[1][1])],
        )
    assert packed.modules["model.layers.0.self_attn.q_proj"].batch.layout is layout
    with pytest.raises(ValueError, match="input has 4 tokens"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_nan_in_one_job_leaves_the_other_jobs_update_exact():
    jobs = [job("bad"), job("good", rank=8, seed=1)]
    data = batches_for(jobs, seed=2)
    updates = []
    for poison in (False, True):
        model = tiny_llama()
        packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend="loop"))
        randomize_b(packed)
        if poison:
            with torch.no_grad():
                packed.modules["model.layers.1.mlp.up_proj"].lora_A[0][0, 0] = math.nan
        bad_before = params_of(packed, 0)
        opt = PerAdapterOptimizer(packed)
        losses, reports = packed_train_step(packed, opt, data)
        updates.append((losses, reports, params_of(packed, 1)))
        if poison:
            assert math.isnan(losses[0]) and math.isfinite(losses[1])
            assert not reports[0].stepped and "non-finite" in reports[0].reason
            assert reports[1].stepped
            for got, want in zip(params_of(packed, 0), bad_before, strict=True):
                torch.testing.assert_close(got, want, equal_nan=True)  # not stepped
            # skipped on the device (found_inf): the state is made but as before any step
            for state in opt.optimizers[0].state.values():
                assert float(state["step"]) == 0.0
                assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    (_, _, clean_good), (_, _, poisoned_good) = updates
    for got, want in zip(poisoned_good, clean_good, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_skipped_step_leaves_no_trace_in_the_next_one():
    """A non-finite step is skipped on the device; the job's next step is its first."""
    jobs = [job("a", max_grad_norm=1.0), job("b", rank=8, seed=1)]
    finals = []
    for skip_first in (False, True):
        packed = convert_to_packed_lora(tiny_llama(), jobs, PackedLoraConfig(backend="loop"))
        opt = PerAdapterOptimizer(packed)
        g = torch.Generator().manual_seed(3)
        grads = [torch.randn(p.shape, generator=g) for p in packed.adapter_parameters(0)]
        if skip_first:
            for p, grad in zip(packed.adapter_parameters(0), grads, strict=True):
                p.grad = grad.clone()
            packed.adapter_parameters(0)[0].grad[0, 0] = math.inf
            (report,) = opt.step([0])
            assert not report.stepped and math.isinf(report.grad_norm)
        for p, grad in zip(packed.adapter_parameters(0), grads, strict=True):
            p.grad = grad.clone()
        (report,) = opt.step([0])
        assert report.stepped and report.grad_norm > 1.0  # clipped to 1.0
        finals.append(params_of(packed, 0))
    for got, want in zip(finals[1], finals[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_state_saved_by_a_foreach_adamw_still_skips_on_the_device():
    packed = convert_to_packed_lora(tiny_llama(), [job("a")], PackedLoraConfig(backend="loop"))
    opt = PerAdapterOptimizer(packed)
    state = opt.state_dict(0)
    for group in state["param_groups"]:
        group["fused"], group["foreach"] = None, True  # as the unfused CPU path saved it
    opt.load_state_dict(0, state)
    before = params_of(packed, 0)
    for p in packed.adapter_parameters(0):
        p.grad = torch.full_like(p, math.nan)
    (report,) = opt.step()
    assert not report.stepped
    for got, want in zip(params_of(packed, 0), before, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_kernels), "loop"])
def test_every_job_of_a_linear_trains_through_two_packed_leaves(backend):
    """However many jobs a pack holds, a linear has two trainable leaves (one gradient
    accumulation each a step); the per-job optimizer leaves alias their rows, gradients
    included, and a model-level `zero_grad(set_to_none=True)` between steps is followed."""
    jobs = [job("a", rank=2), job("b", rank=8, seed=1), job("c", rank=4, seed=2)]
    model = tiny_llama()
    packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend=backend))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(packed.modules)
    layer = packed.modules["model.layers.0.self_attn.q_proj"]
    assert layer.lora_packed_A.shape == (14, 32) and layer.lora_packed_Bt.shape == (14, 32)
    alias_a, alias_bt = layer.adapter_parameters(1)
    assert alias_a.data_ptr() == layer.lora_packed_A[2:].data_ptr()
    assert alias_bt.shape == (8, 32) and layer.lora_B[1].shape == (32, 8)
    model.zero_grad(set_to_none=True)
    packed.set_batch([0, 1, 2], SEQ)
    model(input_ids=torch.randint(0, VOCAB, (3, SEQ))).logits.sum().backward()
    # bound by the backward itself (a post-accumulate-grad hook), no sync call in between
    assert alias_a.grad is not None
    assert alias_a.grad.data_ptr() == layer.lora_packed_A.grad[2:].data_ptr()
    opt = PerAdapterOptimizer(packed)
    opt.zero_grad()
    packed_train_step(packed, opt, batches_for(jobs))
    model.zero_grad(set_to_none=True)  # the user's own call: the packed gradients go
    before = params_of(packed, 1)
    packed_train_step(packed, opt, batches_for(jobs, seed=1))
    assert all(
        not torch.equal(a, b) for a, b in zip(params_of(packed, 1), before, strict=True)
    )  # the aliases were re-bound to the new gradients, so the job stepped
    torch.testing.assert_close(layer.lora_packed_A.detach()[2:10], alias_a.detach())
    # a gradient set on an alias by hand is not a view of the packed one: zero_grad drops it
    alias_a.grad = torch.ones_like(alias_a)
    opt.zero_grad()
    assert alias_a.grad is None and torch.all(layer.lora_packed_A.grad == 0)
    packed.sync_adapter_parameters()
    assert alias_bt.grad is not None and alias_bt.grad.data_ptr() == (
        layer.lora_packed_Bt.grad[2:].data_ptr()
    )


@needs_kernels
def test_the_unfused_op_path_trains_the_packed_leaves_like_the_loop():
    """A base with a hook cannot run inside the packed op: the base runs alone, then the
    adapters' op on the packed factors (B^T read as a strided view); its gradients match
    the plain-torch loop's."""
    jobs = [job("a", rank=2), job("b", rank=5, seed=1)]
    grads = {}
    for backend in ("triton", "loop"):
        torch.manual_seed(0)
        base = nn.Linear(24, 40)
        base.register_forward_hook(lambda module, args, out: out * 1.0)
        wrapper = nn.Sequential(base)
        packed = convert_to_packed_lora(
            wrapper, jobs, PackedLoraConfig(target_modules=("0",), backend=backend)
        )
        randomize_b(packed)
        layer = packed.modules["0"]
        assert not layer._base_fusable(torch.zeros(1, 24))
        packed.set_batch([0, 1, 1], tokens_per_sample=3)
        x = torch.randn(3, 3, 24, generator=torch.Generator().manual_seed(1))
        wrapper(x).square().sum().backward()
        grads[backend] = (layer.lora_packed_A.grad.clone(), layer.lora_packed_Bt.grad.clone())
    for got, want in zip(grads["triton"], grads["loop"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert got.abs().sum() > 0


def test_an_optimizer_state_saved_with_b_as_out_by_rank_still_loads():
    """States saved before the packed layout kept B's moments as [out, r]; they load
    transposed, and a state that fits neither orientation is refused."""
    jobs = [job("a", rank=4)]
    packed = convert_to_packed_lora(tiny_llama(), jobs, PackedLoraConfig(backend="loop"))
    opt = PerAdapterOptimizer(packed)
    packed_train_step(packed, opt, batches_for(jobs))
    state = opt.state_dict(0)
    old = {
        **state,
        "state": {
            slot: {
                k: (v.t().clone() if k.startswith("exp_avg") and slot % 2 else v.clone())
                for k, v in entry.items()
            }
            for slot, entry in state["state"].items()
        },
    }
    assert old["state"][1]["exp_avg"].shape == (32, 4)  # B's moments as [out, r]
    fresh = PerAdapterOptimizer(packed)
    fresh.load_state_dict(0, old)
    for slot, entry in fresh.state_dict(0)["state"].items():
        torch.testing.assert_close(entry["exp_avg"], state["state"][slot]["exp_avg"])
    bad = {**state, "state": {**state["state"], 1: {**state["state"][1]}}}
    bad["state"][1]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises((ValueError, RuntimeError)):
        PerAdapterOptimizer(packed).load_state_dict(0, bad)


def test_checkpoint_roundtrip_and_mismatched_rank_changes_nothing(tmp_path):
    jobs = [job("a", rank=4), job("b", rank=8, seed=1)]
    model = tiny_llama()
    packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend="loop"))
    randomize_b(packed)
    opt = PerAdapterOptimizer(packed)
    packed_train_step(packed, opt, batches_for(jobs))
    saved = [params_of(packed, i) for i in range(2)]
    folder = save_adapter(packed, 1, tmp_path / "b", optimizer=opt)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 8.0 and len(config["target_modules"]) == 14
    assert not list(tmp_path.glob(".*"))  # no temporary folder left behind
    packed.remove()

    fresh = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend="loop"))
    fresh_opt = PerAdapterOptimizer(fresh)
    untouched = [params_of(fresh, i) for i in range(2)]
    with pytest.raises(ValueError, match=r"rank 8 does not match adapter 'a' rank 4"):
        load_adapter(fresh, 0, folder, optimizer=fresh_opt)
    for i in range(2):
        for got, want in zip(params_of(fresh, i), untouched[i], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    load_adapter(fresh, 1, folder, optimizer=fresh_opt)
    for got, want in zip(params_of(fresh, 1), saved[1], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert fresh_opt.state_dict(1)["state"]  # AdamW moments came back too
    with pytest.raises(FileNotFoundError, match="not a LoRA checkpoint"):
        load_adapter(fresh, 1, tmp_path / "nothing-here")


def test_remove_restores_the_model_and_bad_configs_are_refused():
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    packed = convert_to_packed_lora(model, [job("a"), job("b", seed=1)])
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    packed.remove()
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference)
    with pytest.raises(ValueError, match="unique"):
        convert_to_packed_lora(model, [job("a"), job("a")])
    with pytest.raises(ValueError, match=r"no nn\.Linear"):
        convert_to_packed_lora(model, [job("a")], PackedLoraConfig(target_modules=("nope",)))
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        job("x", rank=0)
    with pytest.raises(ValueError, match="exactly one of steps and tokens"):
        LoraJobConfig("x", 4, 8, 1e-3, 1, steps=2, tokens=100)
    with pytest.raises(ValueError, match="unknown keys"):
        LoraJobConfig.from_dict(
            {
                "name": "x",
                "rank": 4,
                "alpha": 8,
                "lr": 1e-3,
                "batch_size": 1,
                "steps": 1,
                "lora_rank": 3,
            }
        )
    assert LoraJobConfig("t", 4, 8, 1e-3, 2, tokens=100).num_steps(seq_len=16) == 4


# ---- the runner, on a tiny random Llama checkpoint folder ----


WORDS = [f"w{i}" for i in range(16)]
RUN_SEQ = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A local Hugging Face folder: random tiny Llama weights and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-llama")
    vocab = {w: i for i, w in enumerate(["[UNK]", "[EOS]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")
    tokenizer.save_pretrained(folder)
    tiny_llama(vocab_size=len(vocab)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def texts():
    g = torch.Generator().manual_seed(0)
    return [
        " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (40,), generator=g))
        for _ in range(12)
    ]


def _runner():
    return RunnerConfig(
        seq_len=RUN_SEQ, dtype=torch.float32, device="cpu", packed=PackedLoraConfig(backend="loop")
    )


def test_trained_adapters_load_in_peft_and_give_the_packed_outputs(checkpoint, texts, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    jobs = [
        LoraJobConfig("r4", rank=4, alpha=8, lr=2e-2, batch_size=2, steps=3),
        LoraJobConfig("r8", rank=8, alpha=4, lr=1e-2, batch_size=1, steps=2, seed=1),
        LoraJobConfig("r2", rank=2, alpha=2, lr=1e-2, batch_size=1, tokens=3 * RUN_SEQ, seed=2),
    ]
    results = train_packs(
        checkpoint, jobs, [["r4", "r8"], ["r2"]], texts, tmp_path, config=_runner()
    )
    assert [(r.name, r.status, r.steps, r.pack) for r in results] == [
        ("r4", "done", 3, 0),
        ("r8", "done", 2, 0),
        ("r2", "done", 3, 1),
    ]
    record = json.loads((tmp_path / "r8" / "loka_job.json").read_text())
    assert record["job"]["rank"] == 8 and len(record["metrics"]["losses"]) == 2

    ids = torch.randint(2, 2 + len(WORDS), (2, RUN_SEQ), generator=torch.Generator().manual_seed(3))
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    packed = convert_to_packed_lora(base, jobs, PackedLoraConfig(backend="loop"))
    for i, j in enumerate(jobs):
        load_adapter(packed, i, tmp_path / j.name)
    packed.set_batch([1, 1], RUN_SEQ)
    with torch.no_grad():
        packed_logits = base(input_ids=ids).logits
    packed.remove()

    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32), tmp_path / "r8"
    )
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids).logits
    assert (peft_logits - base_logits).abs().max() > 1e-4  # the adapter really trained
    torch.testing.assert_close(peft_logits, packed_logits, rtol=1e-4, atol=1e-5)


def test_a_diverging_job_stops_and_its_pack_mate_trains_as_if_alone(checkpoint, texts, tmp_path):
    good = LoraJobConfig("good", rank=4, alpha=8, lr=1e-2, batch_size=1, steps=3, seed=4)
    # An absurd learning rate blows the adapter up after its first step.
    bad = LoraJobConfig(
        "bad", rank=4, alpha=8, lr=1e30, batch_size=1, steps=3, seed=5, max_grad_norm=None
    )
    packed = train_packs(
        checkpoint, [bad, good], [["bad", "good"]], texts, tmp_path / "p", config=_runner()
    )
    alone = train_packs(checkpoint, [good], [["good"]], texts, tmp_path / "a", config=_runner())
    by_name = {r.name: r for r in packed}
    assert by_name["bad"].status == "diverged" and by_name["bad"].steps < 3
    assert "non-finite" in by_name["bad"].reason
    assert by_name["good"].status == "done"
    assert by_name["good"].losses == pytest.approx(alone[0].losses, rel=1e-5)
    assert all(math.isfinite(v) for v in by_name["good"].losses)


def test_bad_plans_are_refused_before_training(checkpoint, texts, tmp_path):
    jobs = [LoraJobConfig("a", rank=4, alpha=8, lr=1e-2, batch_size=1, steps=1)]
    with pytest.raises(ValueError, match=r"not placed \['a'\]"):
        train_packs(checkpoint, jobs, [], texts, tmp_path, config=_runner())
    with pytest.raises(ValueError, match=r"unknown \['b'\]"):
        train_packs(checkpoint, jobs, [["a", "b"]], texts, tmp_path, config=_runner())
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        train_packs(tmp_path, jobs, [["a"]], texts, tmp_path, config=_runner())
    assert not (tmp_path / "a").exists()


def test_profile_pack_measures_a_step_and_leaves_the_model_as_it_was(checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    jobs = [
        LoraJobConfig("a", rank=4, alpha=8, lr=1e-2, batch_size=2, steps=1),
        LoraJobConfig("b", rank=8, alpha=8, lr=1e-2, batch_size=1, steps=1),
    ]
    profile = profile_pack(model, jobs, RUN_SEQ, config=PackedLoraConfig(backend="loop"), steps=1)
    assert profile.n_adapters == 2 and profile.tokens == 3 * RUN_SEQ
    assert profile.rank_tokens == 4 * 2 * RUN_SEQ + 8 * RUN_SEQ
    assert profile.step_time_s > 0
    assert not any("lora_" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("backend", ["loop", pytest.param("triton", marks=needs_kernels)])
def test_jobs_of_different_lengths_pack_and_each_trains_as_if_alone(backend):
    # Lengths 8, 3 and 4 in one pack: rows of 8 tokens hold two 3- or 4-token samples (the
    # 3-token rows end in 2 pads, the 3rd sample of "short" gets a row of its own).
    jobs = [
        job("long", rank=4, batch_size=2, seed=1, seq_len=8),
        job("short", rank=2, alpha=4, batch_size=3, seed=2, seq_len=3),
        job("mid", rank=8, batch_size=2, seed=3, lr=3e-3, seq_len=4),
    ]
    g = torch.Generator().manual_seed(7)
    batches = [
        (i, torch.randint(2, VOCAB, (j.batch_size, j.seq_len + 1), generator=g))
        for i, j in enumerate(jobs)
    ]
    model = tiny_llama()
    packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend=backend))
    randomize_b(packed)
    opt = PerAdapterOptimizer(packed)
    losses, _ = packed_train_step(packed, opt, batches)
    layout = packed._batch.layout
    # 2 rows for "long", 2 for "short" (2 + 1 samples), 1 for "mid": one segment each.
    assert list(layout.token_starts) == [0, 16, 32] and list(layout.token_ends) == [16, 32, 40]
    got = [params_of(packed, i) for i in range(3)]
    packed.remove()
    for i, j in enumerate(jobs):
        solo = convert_to_packed_lora(model, [j], PackedLoraConfig(backend=backend))
        randomize_b(solo)
        with torch.no_grad():  # the packed run's B of this job, before its step
            for module, start in zip(solo.modules.values(), _b_of(i, jobs), strict=True):
                module.lora_B[0].copy_(start)
        solo_losses, _ = packed_train_step(solo, PerAdapterOptimizer(solo), [(0, batches[i][1])])
        assert losses[i] == pytest.approx(solo_losses[0], rel=1e-5)
        for a, b in zip(got[i], params_of(solo, 0), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        solo.remove()


def _b_of(index, jobs):
    """Adapter `index`'s B factors as `randomize_b` sets them in a pack of `jobs`."""
    model = tiny_llama()
    packed = convert_to_packed_lora(model, jobs, PackedLoraConfig(backend="loop"))
    randomize_b(packed)
    out = [module.lora_B[index].detach().clone() for module in packed.modules.values()]
    packed.remove()
    return out


def test_pack_rows_and_the_runner_refuse_a_job_longer_than_the_data(tmp_path):
    from loka.plora.config import pack_rows

    jobs = [job("a", batch_size=3, seq_len=3), job("b", batch_size=2, seq_len=8), job("c")]
    rows = pack_rows(jobs, 8)
    assert (rows.row_len, rows.samples_per_row, rows.rows) == (8, (2, 1, 1), (2, 2, 1))
    assert rows.tokens == (16, 16, 8) and rows.shares_rows
    same = pack_rows([job("a", batch_size=3), job("b", batch_size=2)], 8)
    assert same.tokens == (24, 16) and not same.shares_rows
    with pytest.raises(ValueError, match=r"jobs \['b'\] have a seq_len above the runner's"):
        train_packs(tiny_llama(), jobs[1:], [["b", "c"]], None, tmp_path,
                    config=RunnerConfig(seq_len=4))  # fmt: skip


def test_train_packs_and_profile_pack_run_each_job_at_its_own_length(tmp_path, monkeypatch):
    from loka.plora import TokenBlocks, runner

    shapes = []  # the [samples, length + 1] of every job's batch at every step
    rows = runner._packed_rows

    def spy(batches):
        shapes.append({i: tuple(b.shape) for i, b in batches})
        return rows(batches)

    monkeypatch.setattr(runner, "_packed_rows", spy)

    jobs = [
        LoraJobConfig("long", rank=4, alpha=8, lr=1e-2, batch_size=1, steps=3),
        LoraJobConfig("short", rank=2, alpha=4, lr=1e-2, batch_size=3, steps=2, seq_len=4, seed=1),
        LoraJobConfig("by-tokens", rank=2, alpha=4, lr=1e-2, batch_size=2, tokens=40, seq_len=5),
    ]
    ids = torch.randint(0, VOCAB, (2000,), generator=torch.Generator().manual_seed(3)).tolist()
    data = TokenBlocks.from_token_ids(ids, seq_len=SEQ)
    config = RunnerConfig(seq_len=SEQ, dtype=torch.float32, device="cpu",
                          packed=PackedLoraConfig(backend="loop"))  # fmt: skip
    results = {r.name: r for r in train_packs(tiny_llama(), jobs, [[j.name for j in jobs]], data,
                                              tmp_path, config=config)}  # fmt: skip
    assert {n: r.status for n, r in results.items()} == dict.fromkeys(results, "done")
    # tokens at the job's own length: 40 tokens of 2 x 5 per step are 4 steps
    assert {n: (r.steps, r.tokens) for n, r in results.items()} == {
        "long": (3, 3 * SEQ), "short": (2, 2 * 3 * 4), "by-tokens": (4, 4 * 2 * 5)}  # fmt: skip
    assert all(math.isfinite(r.final_loss) for r in results.values())
    assert shapes[0] == {0: (1, SEQ + 1), 1: (3, 5), 2: (2, 6)}
    assert shapes[2:] == [{0: (1, SEQ + 1), 2: (2, 6)}, {2: (2, 6)}]  # jobs leave when done
    profile = profile_pack(tiny_llama(), jobs[:2], SEQ, config=PackedLoraConfig(backend="loop"),
                           steps=1, warmup=0)  # fmt: skip
    # "short" puts 2 samples to a row of 8: 2 rows; the step processed 8 + 16 tokens.
    assert (profile.tokens, profile.rank_tokens) == (8 + 16, 4 * 8 + 2 * 16)


# --- under torch.compile --------------------------------------------------------------------
# Compiling a packed model used to fail: Dynamo traced into the Triton launchers of the
# packed op (in the interpreter: "KeyError(torch.uint64)" from a fake-tensor call). The
# packed linears now run eagerly between compiled regions, so a compiled step must train
# exactly as the eager one and compile nothing new once the pack is steady.


def _train(backend: str, loss_fn, steps: int = 3):
    jobs = [job("a", rank=4, batch_size=2), job("b", rank=8, alpha=4, seed=1, lr=3e-3)]
    packed = convert_to_packed_lora(tiny_llama(), jobs, PackedLoraConfig(backend=backend))
    randomize_b(packed)  # B = 0 would leave dA zero, so its check could not fail
    opt = PerAdapterOptimizer(packed)
    losses = [packed_train_step(packed, opt, batches_for(jobs, seed=s), loss_fn=loss_fn)[0]
              for s in range(steps)]  # fmt: skip
    params = [params_of(packed, i) for i in range(len(jobs))]
    packed.remove()
    return losses, params


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_kernels), "loop"])
def test_compiled_packed_steps_train_like_eager_ones(backend):
    torch._dynamo.reset()
    counters.clear()
    eager_losses, eager_params = _train(backend, token_losses)
    compiled_losses, compiled_params = _train(backend, compiled_loss(backend="aot_eager"))
    for got, want in zip(compiled_losses, eager_losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    assert compiled_losses[-1] != pytest.approx(compiled_losses[0], rel=1e-6)  # it trained
    for got_list, want_list in zip(compiled_params, eager_params, strict=True):
        for got, want in zip(got_list, want_list, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert counters["stats"]["unique_graphs"] > 0  # the step did compile around the op


def test_a_steady_compiled_pack_compiles_nothing_new():
    torch._dynamo.reset()
    jobs = [job("a", rank=4, batch_size=2), job("b", rank=8, seed=1)]
    packed = convert_to_packed_lora(tiny_llama(), jobs, PackedLoraConfig(backend="loop"))
    opt = PerAdapterOptimizer(packed)
    loss_fn = compiled_loss(backend="aot_eager")
    for seed in range(2):  # the first steps compile (and recompile once for requires_grad)
        packed_train_step(packed, opt, batches_for(jobs, seed=seed), loss_fn=loss_fn)
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(2, 5):
            packed_train_step(packed, opt, batches_for(jobs, seed=seed), loss_fn=loss_fn)
    assert counters["stats"]["unique_graphs"] == 0
    packed.remove()


def test_profile_pack_times_compiled_steps():
    torch._dynamo.reset()
    jobs = [job("a", rank=4, batch_size=2), job("b", rank=8, seed=1)]
    model = tiny_llama()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    profile = profile_pack(model, jobs, 8, config=PackedLoraConfig(backend="loop"), steps=1,
                           warmup=0, compile=True)  # fmt: skip
    assert profile.step_time_s > 0 and profile.n_adapters == 2 and profile.tokens == 3 * 8
    after = dict(model.named_parameters())
    assert set(after) == set(before)  # the packed layers were taken out again
    for name, value in before.items():
        assert torch.equal(after[name].detach(), value)


# --- the optimizer step as a CUDA graph -----------------------------------------------------


class _StepGraph:
    """A CPU stand-in for a captured CUDA graph of the optimizer step: capturing runs nothing
    (as a CUDA capture executes no kernel), each replay runs the step and writes its norms
    into the one output tensor the capture returned."""

    def __init__(self, fn) -> None:
        self.fn, self.out = fn, torch.empty(0)

    def replay(self) -> None:
        norms = self.fn()
        self.out.resize_(norms.shape).copy_(norms)


def _stand_in_capture(fn):
    graph = _StepGraph(fn)
    return graph, graph.out


def test_graphed_optimizer_steps_equal_eager_ones_and_capture_per_active_set():
    """Graphs on (a CPU stand-in for the CUDA capture) against off: the same parameters,
    norms and reports over steps whose active jobs change (a job leaving the pack), with
    clipping; the first step of each active set runs op by op, the second captures (and
    replays once), later ones replay."""
    jobs = [job("a", max_grad_norm=0.05), job("b", rank=8, seed=1, lr=3e-3), job("c", seed=2)]
    runs = []
    for graphs in (False, True):
        packed = convert_to_packed_lora(tiny_llama(), jobs, PackedLoraConfig(backend="loop"))
        randomize_b(packed)
        opt = PerAdapterOptimizer(packed, graphs=graphs, capture=_stand_in_capture)
        norms = []
        for step in range(7):
            active = (0, 1, 2) if step < 4 else (0, 2)
            data = [b for b in batches_for(jobs, seed=step) if b[0] in active]
            _, reports = packed_train_step(packed, opt, data)
            norms.append([r.grad_norm for r in reports])
        runs.append((norms, [params_of(packed, i) for i in range(3)], dict(opt.graph_stats)))
        packed.remove()
    (norms_off, params_off, _), (norms_on, params_on, stats) = runs
    for got, want in zip(norms_on, norms_off, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    for got_list, want_list in zip(params_on, params_off, strict=True):
        for got, want in zip(got_list, want_list, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Active set (0, 1, 2): eager, capture, replay, replay; (0, 2): eager, capture, replay.
    assert stats == {"eager": 2, "captures": 2, "replays": 3}


def test_loading_a_jobs_optimizer_state_drops_the_captured_steps():
    jobs = [job("a"), job("b", rank=8, seed=1)]
    packed = convert_to_packed_lora(tiny_llama(), jobs, PackedLoraConfig(backend="loop"))
    opt = PerAdapterOptimizer(packed, graphs=True, capture=_stand_in_capture)
    for seed in range(3):
        packed_train_step(packed, opt, batches_for(jobs, seed=seed))
    assert opt.graph_stats["captures"] == 1
    opt.load_state_dict(0, opt.state_dict(0))
    packed_train_step(packed, opt, batches_for(jobs, seed=3))
    assert opt.graph_stats == {"eager": 2, "captures": 1, "replays": 1}  # eager again


def test_moved_packed_parameters_are_not_stepped_from_a_stale_graph():
    """A graph writes the parameters where they were when captured: once the packed storage
    moves (as `.to()` moves it), the next step runs op by op, and later ones capture anew."""
    jobs = [job("a"), job("b", rank=8, seed=1)]
    packed = convert_to_packed_lora(tiny_llama(), jobs, PackedLoraConfig(backend="loop"))
    opt = PerAdapterOptimizer(packed, graphs=True, capture=_stand_in_capture)
    for seed in range(3):
        packed_train_step(packed, opt, batches_for(jobs, seed=seed))
    assert opt.graph_stats == {"eager": 1, "captures": 1, "replays": 1}
    with torch.no_grad():
        for module in packed.modules.values():
            module.lora_packed_A.data = module.lora_packed_A.data.clone()
    packed_train_step(packed, opt, batches_for(jobs, seed=3))
    assert opt.graph_stats == {"eager": 2, "captures": 1, "replays": 1}


def test_the_runner_trains_compiled_as_eager_while_jobs_leave(tmp_path, monkeypatch):
    """`RunnerConfig(compile=True)`: jobs of different lengths and step counts (the pack's
    token count changes as they leave) end with the losses of the eager runner. Dynamo's
    aot_eager backend stands in for inductor (minutes on a CPU)."""
    from loka.plora import TokenBlocks, runner

    monkeypatch.setattr(runner, "compiled_loss", lambda: compiled_loss(backend="aot_eager"))
    torch._dynamo.reset()
    jobs = [
        LoraJobConfig("long", rank=4, alpha=8, lr=1e-2, batch_size=1, steps=3),
        LoraJobConfig("short", rank=2, alpha=4, lr=1e-2, batch_size=3, steps=2, seq_len=4, seed=1),
    ]
    ids = torch.randint(0, VOCAB, (2000,), generator=torch.Generator().manual_seed(3)).tolist()
    data = TokenBlocks.from_token_ids(ids, seq_len=SEQ)
    losses, graphs = [], []
    for compile_ in (False, True):
        counters.clear()
        config = RunnerConfig(seq_len=SEQ, dtype=torch.float32, device="cpu", compile=compile_,
                              packed=PackedLoraConfig(backend="loop"))  # fmt: skip
        results = train_packs(tiny_llama(), jobs, [[j.name for j in jobs]], data,
                              tmp_path / str(compile_), config=config)  # fmt: skip
        losses.append({r.name: r.losses for r in results})
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == 0 and graphs[1] > 0  # the compiled run did compile
    eager, compiled = losses
    assert {n: len(v) for n, v in compiled.items()} == {"long": 3, "short": 2}
    for name, values in eager.items():
        assert compiled[name] == pytest.approx(values, rel=1e-5)


def test_a_changed_learning_rate_is_not_stepped_from_a_stale_graph():
    """A captured step holds the lr it was captured with: a scheduler's new lr must step op
    by op (then capture anew), with the update eager training gives."""
    jobs = [job("a"), job("b", rank=8, seed=1)]
    finals = []
    for graphs in (False, True):
        packed = convert_to_packed_lora(tiny_llama(), jobs, PackedLoraConfig(backend="loop"))
        randomize_b(packed)
        opt = PerAdapterOptimizer(packed, graphs=graphs, capture=_stand_in_capture)
        for seed in range(5):
            if seed == 3:
                opt.optimizers[0].param_groups[0]["lr"] = 1e-4
            packed_train_step(packed, opt, batches_for(jobs, seed=seed))
        finals.append(([params_of(packed, i) for i in range(2)], dict(opt.graph_stats)))
        packed.remove()
    (eager, _), (graphed, stats) = finals
    for got_list, want_list in zip(graphed, eager, strict=True):
        for got, want in zip(got_list, want_list, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # lr 1e-2: eager, capture, replay; lr 1e-4: eager, capture.
    assert stats == {"eager": 2, "captures": 2, "replays": 1}
