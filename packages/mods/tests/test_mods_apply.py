"""loka.mods.apply on the zoo's tiny models: bf16 mods change nothing, FP8 mods match the
emulation site by site, bad specs leave the model untouched, mods train and resume, undo."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; before loka.kernels

import copy
import importlib

import pytest
import torch
from torch import nn

import loka.zoo as zoo
from loka.mods.apply import ModsError, apply, undo
from loka.mods.config import Fp8LinearConfig
from loka.mods.fp8_linear import Fp8Linear
from loka.mods.grouped import GroupedLinear
from loka.mods.norm_linear import FusedNorm, NormLinear
from loka.mods.reference import fp8_linear_reference
from loka.mods.spec import GroupMods, ModSpec, SiteMods, SpecError
from loka.mods.trace import outputs_match, run_model

BF16 = Fp8LinearConfig.bf16()
ROW = "e4m3:e4m3/row/dynamic"


def setup(name, batch_size=16, seed=0):
    s = zoo.create(name, "tiny", batch_size=batch_size, seed=seed)
    return s, next(s.train_batches())


def linears(model):
    return [n for n, m in model.named_modules() if type(m) is nn.Linear]


def loss_and_grads(s, model, batch):
    model.eval()  # no dropout: both models see the same computation
    model.zero_grad()
    loss = s.loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def snapshot(model):
    return (
        [(n, type(m)) for n, m in model.named_modules()],
        {k: v.clone() for k, v in model.state_dict().items()},
        [id(p) for p in model.parameters()],
    )


def assert_unchanged(model, before):
    modules, state, params = snapshot(model)
    assert modules == before[0]
    assert state.keys() == before[1].keys()
    assert all(torch.equal(state[k], before[1][k]) for k in state)
    assert params == before[2]


@pytest.mark.parametrize("name", zoo.MODELS)
def test_bf16_mods_keep_outputs_and_gradients(name):
    s, batch = setup(name)
    model = s.model
    want_loss, want_grads = loss_and_grads(s, model, batch)
    before = snapshot(model)
    spec = ModSpec(
        sites={n: SiteMods(fp8=BF16) for n in linears(model) if ".projections." not in n},
        auto_fuse=True,
        auto_group=True,
    )
    report = apply(model, spec, batch)
    kinds = {c.kind for c in report.changes}
    if name == "dlrm":  # no norms: every linear becomes an Fp8Linear
        assert kinds == {"fp8"}
    else:  # norm -> linear pairs fuse (a fused pair with bf16 passes needs no "fp8" change)
        assert "fuse_norm" in kinds and any(isinstance(m, NormLinear) for m in model.modules())
    if name == "dhen":
        assert isinstance(model.projections, GroupedLinear)
    got_loss, got_grads = loss_and_grads(s, model, batch)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for key, want in want_grads.items():
        torch.testing.assert_close(
            got_grads[key], want, rtol=1e-4, atol=1e-5 * float(want.abs().max())
        )
    report.undo()
    assert_unchanged(model, before)


def test_smoothing_and_folding_keep_outputs_and_undo_restores():
    s, batch = setup("sasrec")
    model = s.model
    with torch.no_grad():  # trained-looking gains, so there is something to smooth
        for block in model.blocks:
            block.ffn_norm.weight.mul_(torch.linspace(0.2, 5.0, block.ffn_norm.weight.numel()))
    reference = run_model(model, batch)
    before = snapshot(model)
    spec = ModSpec(
        sites={
            "blocks.0.ffn_in": SiteMods(smooth=0.5, fold_norm_bias=True),
            "blocks.1.qkv": SiteMods(smooth=0.8, norm="blocks.1.attention_norm"),
        }
    )
    report = apply(model, spec, batch)
    assert [c.kind for c in report.changes] == ["smooth", "smooth", "fold_norm_bias"]
    assert outputs_match(run_model(model, batch), reference) is None
    assert not model.blocks[0].ffn_norm.bias.requires_grad
    undo(model, report)
    assert_unchanged(model, before)
    assert model.blocks[0].ffn_norm.bias.requires_grad


def test_fp8_sites_match_the_emulation():
    s, batch = setup("dhen")
    model = s.model
    config = Fp8LinearConfig(ROW, "e5m2:e4m3/row/dynamic", ROW)
    sites = {n: SiteMods(fp8=config) for n in ("input_projection", "blocks.0.fc2", "head.1")}
    sites["blocks.1.fc1"] = SiteMods(fp8=config, fuse_norm=True)
    spec = ModSpec(sites=sites, groups={"projections": GroupMods("fp8", config)})
    report = apply(model, spec, batch)
    assert isinstance(model.blocks[1].norm, FusedNorm)
    captured = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(
            lambda m, args, out, n=n: captured.__setitem__(n, (args[0].detach(), out.detach()))
        )
        for n in sites
    ]
    run_model(model, batch)
    for hook in hooks:
        hook.remove()
    for name, (x, y) in captured.items():
        module = model.get_submodule(name)
        if isinstance(module, NormLinear):
            x = module.norm.normalize(x)
        ref = fp8_linear_reference(x.reshape(-1, x.shape[-1]), module.weight.detach(), config)
        want = (ref.y + module.bias.detach()).reshape(y.shape).detach()
        torch.testing.assert_close(
            y, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()), msg=name
        )
    loss = s.loss(model, batch)
    loss.backward()
    assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    assert len(report.changes) == 1 + 1 + 4  # group, fusion, four FP8 configs


def bad_specs():
    relu_model = "inputs.bottom.1"  # dhen's bottom MLP: Linear, ReLU, ...
    scaled_mm = Fp8LinearConfig.from_recipes(ROW, ROW, ROW, backend="torch.scaled_mm")
    block = Fp8LinearConfig.from_recipes("e4m3:e4m3/block/dynamic")
    return {
        "missing module": (ModSpec(sites={"blocks.7.fc1": SiteMods(fp8=BF16)}), "no such module"),
        "not a linear": (ModSpec(sites={relu_model: SiteMods(fp8=BF16)}), "not an nn.Linear"),
        "no backend for the shape": (
            ModSpec(sites={"input_projection": SiteMods(fp8=scaled_mm)}),
            "no backend runs",
        ),
        "no norm before it": (
            ModSpec(sites={"blocks.0.fc2": SiteMods(fuse_norm=True)}),
            "no LayerNorm/RMSNorm",
        ),
        "unfusable recipe": (
            ModSpec(sites={"blocks.0.fc1": SiteMods(fuse_norm=True, fp8=block)}),
            "rowwise with dynamic",
        ),
        "not a group": (ModSpec(groups={"blocks.0": GroupMods()}), "group 'blocks.0'"),
    }


@pytest.mark.parametrize("case", bad_specs())
def test_bad_specs_leave_the_model_unchanged(case):
    s, batch = setup("dhen")
    before = snapshot(s.model)
    spec, message = bad_specs()[case]
    with pytest.raises(ModsError, match=message):
        apply(s.model, spec, batch)
    assert_unchanged(s.model, before)


class ResidualNorm(nn.Module):
    """The norm's output feeds the linear and a residual: fusing it would be wrong."""

    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.norm(x)
        return self.linear(h) + h


def test_a_norm_with_another_consumer_is_not_fused():
    torch.manual_seed(0)
    model, x = ResidualNorm(), torch.randn(8, 16)
    before = snapshot(model)
    with pytest.raises(ModsError, match="also feeds something other than the linear"):
        apply(model, ModSpec(sites={"linear": SiteMods(fuse_norm=True)}), x)
    assert_unchanged(model, before)
    report = apply(model, ModSpec(auto_fuse=True), x)  # automatic: skipped, with the reason
    assert report.changes == [] and report.skipped[0][:2] == ("fuse_norm", "linear")


def test_needs_a_sample_when_tracing():
    s, _ = setup("dhen")
    with pytest.raises(ModsError, match="sample batch"):
        apply(s.model, ModSpec(sites={"blocks.0.fc1": SiteMods(fuse_norm=True)}))


def spec_for_training():
    row = Fp8LinearConfig(ROW, ROW, "bf16")
    delayed = Fp8LinearConfig.from_recipes("e4m3:e4m3/tensor/delayed4", "bf16", "bf16")
    return ModSpec(
        sites={
            "blocks.0.fc1": SiteMods(fp8=row, fuse_norm=True),
            "blocks.1.fc2": SiteMods(fp8=delayed),
        },
        auto_group=True,
    )


def train(s, model, optimizer, batches):
    for batch in batches:
        model.train()
        loss = s.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_mods_train_checkpoint_and_resume(tmp_path):
    s, batch = setup("dhen")
    stream = s.train_batches()
    batches = [next(stream) for _ in range(2)]
    model = s.model
    apply(model, spec_for_training(), batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(s, model, optimizer, batches[:1])
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "c.pt"
    )
    train(s, model, optimizer, batches[1:])
    assert model.blocks[1].fc2.amax_history_input[1] > 0  # the history advanced

    resumed_setup, _ = setup("dhen", seed=1)  # different init: everything comes from the file
    resumed = resumed_setup.model
    apply(resumed, spec_for_training(), batch)
    checkpoint = torch.load(tmp_path / "c.pt")
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    train(resumed_setup, resumed, resumed_optimizer, batches[1:])
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_undo_after_training_keeps_what_was_learned():
    s, batch = setup("dhen")
    model = s.model
    initial = copy.deepcopy(model.state_dict())
    report = apply(model, spec_for_training(), batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(s, model, optimizer, [batch])
    trained = {k: v.clone() for k, v in model.state_dict().items() if "amax_history" not in k}
    report.undo()
    assert type(model.blocks[0].fc1) is nn.Linear and type(model.blocks[0].norm) is nn.LayerNorm
    assert type(model.blocks[1].fc2) is nn.Linear and not isinstance(
        model.projections, GroupedLinear
    )
    state = model.state_dict()
    assert state.keys() == initial.keys()
    assert all(torch.equal(state[k], trained[k]) for k in state)
    assert not torch.equal(state["blocks.0.fc1.weight"], initial["blocks.0.fc1.weight"])


def test_spec_from_plan_rows():
    s, batch = setup("dhen")
    rows = []
    for site, recipes in {
        "blocks.0.fc1": (ROW, "e5m2:e4m3/row/dynamic", "bf16"),
        "blocks.0.fc2": ("bf16", "bf16", "bf16"),
        "projections": (ROW, ROW, "bf16"),
    }.items():
        for pass_, recipe in zip(("fwd", "dgrad", "wgrad"), recipes, strict=True):
            backend = "torch.bf16" if recipe == "bf16" else "triton.fp8"
            if site == "projections" and recipe != "bf16":
                backend = "triton.grouped"
            rows.append({"site": site, "pass": pass_, "backend": backend, "recipe": recipe})
    spec = ModSpec.from_plan(rows, fuse_norm=["blocks.0.fc1"], groups=["projections"])
    assert set(spec.sites) == {"blocks.0.fc1"}  # an all-bf16 site is left alone
    assert str(spec.sites["blocks.0.fc1"].fp8.dgrad) == "e5m2:e4m3/row/dynamic@triton.fp8"
    report = apply(s.model, spec, batch)
    assert isinstance(s.model.blocks[0].fc1, NormLinear)
    assert s.model.projections.backend == "fp8"
    assert "blocks.0.fc1" in str(report)
    with pytest.raises(SpecError, match=r"no row for \['wgrad'\]"):
        ModSpec.from_plan(rows[:-1])
    with pytest.raises(SpecError, match="cannot run recipe e4m3"):
        ModSpec.from_plan([{**r, "backend": "torch.bf16", "recipe": ROW} for r in rows])


def test_fp8_linear_stays_a_probe_site():
    s, _ = setup("dlrm")
    apply(s.model, ModSpec(sites={n: SiteMods(fp8=Fp8LinearConfig()) for n in linears(s.model)}))
    assert all(isinstance(m, nn.Linear) for m in s.model.modules() if isinstance(m, Fp8Linear))
    probe = pytest.importorskip("loka.probe.sites", reason="loka-probe is an optional test peer")
    found = probe.find_sites(s.model, lambda name: False)
    assert {site.name for site in found} == {
        n for n, m in s.model.named_modules() if isinstance(m, Fp8Linear)
    }


def test_a_served_bf16_model_fed_float32_features_is_checked_under_autocast():
    # DLRM-style: float32 dense features into a model whose weights were cast to bf16; it
    # runs only under autocast, and so must apply's checks (an H200 end-to-end run failed
    # with "mat1 and mat2 must have the same dtype" before).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)).to(torch.bfloat16)
    features = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="dtype"):
        model(features)
    reference = run_model(model, features)
    assert reference.dtype == torch.bfloat16
    report = apply(model, ModSpec(sites={"2": SiteMods(fold_norm_bias=True)}), features)
    assert [c.kind for c in report.changes] == ["fold_norm_bias"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(model(features), reference, rtol=2e-2, atol=2e-2)
    # An fp32 model is run as called: no autocast is imposed on it.
    fp32 = nn.Linear(16, 8)
    assert run_model(fp32, features).dtype == torch.float32


def test_a_named_norm_is_fused_without_tracing_and_still_checked(monkeypatch):
    mods_apply = importlib.import_module("loka.mods.apply")  # (loka.mods.apply is the function)

    def no_trace(*args, **kwargs):
        raise AssertionError("a named norm needs no trace")

    monkeypatch.setattr(mods_apply, "trace_norm_consumers", no_trace)
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8))
    x = torch.randn(4, 16)
    reference = run_model(model, x)
    report = apply(model, ModSpec(sites={"1": SiteMods(fuse_norm=True, norm="0")}), x)
    assert isinstance(model[1], NormLinear) and isinstance(model[0], FusedNorm)
    assert outputs_match(run_model(model, x), reference) is None
    report.undo()
    # The outputs check catches what no table can say: the norm's output also feeds a residual.
    residual = ResidualNorm()
    with pytest.raises(ModsError) as refused:
        apply(residual, ModSpec(sites={"linear": SiteMods(fuse_norm=True, norm="norm")}), x)
    assert refused.value.problems.keys() == {"linear"}
    with pytest.raises(ModsError, match=r"not an nn\.LayerNorm or nn\.RMSNorm") as refused:
        apply(model, ModSpec(sites={"1": SiteMods(fuse_norm=True, norm="1")}), x)
    assert refused.value.problems.keys() == {"1"}


def test_errors_name_the_sites_at_fault():
    s, batch = setup("dhen")
    before = snapshot(s.model)
    block = Fp8LinearConfig.from_recipes("e4m3:e4m3/block/dynamic", "bf16", "bf16")
    spec = ModSpec(
        sites={
            "blocks.0.fc2": SiteMods(fp8=Fp8LinearConfig()),  # fine
            "blocks.7.fc1": SiteMods(fp8=BF16),  # no such module
            "blocks.0.fc1": SiteMods(fuse_norm=True, fp8=block),  # not a fusable recipe
        }
    )
    with pytest.raises(ModsError) as refused:
        apply(s.model, spec, batch)
    assert refused.value.problems.keys() == {"blocks.7.fc1", "blocks.0.fc1"}
    assert "no such module" in refused.value.problems["blocks.7.fc1"]
    assert_unchanged(s.model, before)


def test_site_mods_from_plan_reads_fusion_and_names_bad_sites():
    from loka.mods.spec import site_mods_from_plan

    def rows(site, recipes, **extra):
        return [
            {"site": site, "pass": p, "backend": None, "recipe": r, **(extra if p == "fwd" else {})}
            for p, r in zip(("fwd", "dgrad", "wgrad"), recipes, strict=True)
        ]

    plan = [
        *rows("a", (ROW, ROW, "bf16"), fuse_norm=True, norm="ln"),
        *rows("b", ("bf16",) * 3),  # all bf16: left alone
        *rows("c", (ROW, "e4m3:e4m3/row/lazy", ROW)),  # a bad recipe
        *rows("d", (ROW, ROW, ROW))[:2],  # no wgrad
    ]
    sites, problems = site_mods_from_plan(plan)
    assert set(sites) == {"a"} and sites["a"].fuse_norm and sites["a"].norm == "ln"
    assert not sites["a"].needs_trace
    assert set(problems) == {"c", "d"} and "no row for ['wgrad']" in problems["d"]
    with pytest.raises(SpecError) as refused:
        ModSpec.from_plan(plan)
    assert refused.value.problems == problems
