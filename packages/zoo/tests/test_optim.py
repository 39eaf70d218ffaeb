"""The sparse path: row-wise Adagrad on sparse table gradients beside AdamW on the rest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# The update kernel is defined at its first launch; on the CPU it runs in the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch import nn

import loka.zoo as zoo
from loka.zoo import rowwise_adagrad
from loka.zoo.layers import global_rows
from loka.zoo.optim import (
    DENSE_EMBEDDINGS,
    FUSED_EMBEDDINGS,
    SPARSE_EMBEDDINGS,
    HybridOptimizer,
    OptimizerConfig,
    RowWiseAdagrad,
    coalesce_rows,
    embedding_update,
    lookup_rows,
    make_optimizer,
)
from loka.zoo.rowwise_adagrad import (
    CHUNK,
    dedupe_rows,
    rowwise_adagrad_reference_,
    rowwise_adagrad_sparse_reference_,
    rowwise_adagrad_sparse_triton_,
    rowwise_adagrad_triton_,
)

LR, EPS = 0.1, 1e-8


def _reference(weight, state, lookups, lr=LR, eps=EPS):
    """Row-wise Adagrad by hand: sum each row's gradients, one accumulator per row."""
    weight, state = weight.clone(), state.clone()
    summed: dict[int, torch.Tensor] = {}
    for row, grad in lookups:
        summed[row] = summed.get(row, torch.zeros_like(grad)) + grad
    for row, grad in summed.items():
        state[row] += float((grad * grad).mean())
        weight[row] -= lr * grad / (state[row].sqrt() + eps)
    return weight, state


def _sparse_grad(lookups, shape):
    rows = torch.tensor([[row for row, _ in lookups]])
    values = torch.stack([grad for _, grad in lookups])
    with torch.sparse.check_sparse_tensor_invariants():
        return torch.sparse_coo_tensor(rows, values, shape)


@pytest.mark.parametrize("dedupe", ["sort", "coalesce"])
def test_update_matches_a_hand_written_reference_over_steps(dedupe: str) -> None:
    g = torch.Generator().manual_seed(0)
    table = nn.Parameter(torch.randn(10, 4, generator=g))
    optimizer = RowWiseAdagrad([table], lr=LR, eps=EPS, dedupe=dedupe)
    weight, state = table.detach().clone(), torch.zeros(10)
    for rows in ([1, 4, 4, 7], [4, 2], [9, 1, 1, 1]):
        lookups = [(row, torch.randn(4, generator=g)) for row in rows]
        table.grad = _sparse_grad(lookups, table.shape)
        optimizer.step()
        weight, state = _reference(weight, state, lookups)
        torch.testing.assert_close(table.detach(), weight)
        torch.testing.assert_close(optimizer.state[table]["sum"], state)


def test_only_touched_rows_change_and_duplicates_are_coalesced() -> None:
    g = torch.Generator().manual_seed(1)
    start = torch.randn(8, 3, generator=g)
    a, b = torch.randn(3, generator=g), torch.randn(3, generator=g)
    twice, once = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    twice.grad = _sparse_grad([(5, a), (2, b), (5, b)], twice.shape)
    once.grad = _sparse_grad([(2, b), (5, a + b)], once.shape)
    for table in (twice, once):
        RowWiseAdagrad([table], lr=LR).step()
    # A row looked up twice gets one update with its summed gradient.
    torch.testing.assert_close(twice.detach(), once.detach())
    changed = (twice.detach() != start).any(1)
    assert changed.nonzero().flatten().tolist() == [2, 5]
    # Not two sequential updates of the same row:
    sequential = nn.Parameter(start.clone())
    optimizer = RowWiseAdagrad([sequential], lr=LR)
    for grad in (a, b):
        sequential.grad = _sparse_grad([(5, grad)], sequential.shape)
        optimizer.step()
    assert not torch.allclose(sequential.detach()[5], twice.detach()[5])


def test_rejects_dense_gradients_and_bad_settings() -> None:
    table = nn.Parameter(torch.zeros(4, 2))
    table.grad = torch.ones(4, 2)
    with pytest.raises(ValueError, match="sparse_embeddings=True"):
        RowWiseAdagrad([table]).step()
    with pytest.raises(ValueError, match="lr > 0"):
        RowWiseAdagrad([table], lr=0.0)
    with pytest.raises(ValueError, match="2-D tables"):
        RowWiseAdagrad([nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="embedding_lr"):
        OptimizerConfig(embedding_lr=-1.0)
    with pytest.raises(ValueError, match="dedupe"):
        RowWiseAdagrad([table], dedupe="hash")
    with pytest.raises(ValueError, match="embedding_dedupe"):
        OptimizerConfig(embedding_dedupe="hash")


def test_make_optimizer_splits_tables_from_dense_parameters() -> None:
    dense = zoo.create("dhen")
    optimizer = make_optimizer(dense.model)
    assert (
        isinstance(optimizer, torch.optim.AdamW)
        and embedding_update(dense.model) == DENSE_EMBEDDINGS
    )
    assert len(optimizer.param_groups[0]["params"]) == len(list(dense.model.parameters()))

    sparse = zoo.create("interformer", sparse_embeddings=True)
    optimizer = make_optimizer(sparse.model, OptimizerConfig(lr=2e-3, embedding_lr=0.1))
    assert isinstance(optimizer, HybridOptimizer)
    assert embedding_update(sparse.model) == SPARSE_EMBEDDINGS
    bags, items = sparse.model.inputs.embeddings.bags, sparse.model.items
    tables = {id(bags.weight), id(items.weight)}
    groups = optimizer.sparse.param_groups
    assert {id(p) for g in groups for p in g["params"]} == tables
    # Both tables keep their padding lookups (no padding_idx: no host sync in the sparse
    # backward) and the optimizer's group names the padding row.
    padding = {id(p): g["padding_row"] for g in groups for p in g["params"]}
    assert bags.padding_idx is None and padding[id(bags.weight)] == 0
    assert items.padding_idx is None and padding[id(items.weight)] == 0
    assert zoo.create("interformer").model.items.padding_idx == 0  # dense: padding_idx
    dense_ids = {id(p) for p in optimizer.dense.param_groups[0]["params"]}
    assert not dense_ids & tables
    assert dense_ids | tables == {id(p) for p in sparse.model.parameters()}
    assert [group["lr"] for group in optimizer.param_groups] == [2e-3, 0.1]


@pytest.mark.parametrize("name", ["dhen", "hstu"])
def test_training_with_sparse_tables_lowers_the_loss(name: str) -> None:
    setup = zoo.create(name, sparse_embeddings=True)
    table = (
        setup.model.inputs.embeddings.bags.weight
        if name == "dhen"
        else setup.model.item_embeddings.weight
    )
    before = table.detach().clone()
    losses = zoo.train(setup, 40, lr=3e-3)
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.97 * first, f"loss {first:.4f} -> {last:.4f}"
    # The tables moved only where batches looked them up; the padding row never.
    assert (table.detach() != before).any(1).sum() > 0
    torch.testing.assert_close(table.detach()[0], before[0])


@pytest.mark.parametrize("dedupe", ["sort", "coalesce"])
def test_sparse_bags_without_padding_idx_update_like_bags_with_it(dedupe: str) -> None:
    # FeatureEmbeddings' sparse table leaves padding_idx out (its backward's mask syncs with
    # the host); the optimizer skipping the padding row must give the same training.
    setup = zoo.create("dlrm", sparse_embeddings=True, batch_size=64)
    model = setup.model
    bags = model.inputs.embeddings.bags
    assert bags.padding_idx is None
    twin = nn.EmbeddingBag(*bags.weight.shape, mode="sum", padding_idx=0, sparse=True)
    twin.weight.data.copy_(bags.weight.data)
    config = OptimizerConfig(embedding_lr=0.5, embedding_dedupe=dedupe)
    ours = make_optimizer(model, config).sparse
    theirs = RowWiseAdagrad(twin.parameters(), lr=0.5, dedupe=dedupe)
    batches = setup.train_batches()
    for _ in range(3):
        sparse = next(batches)["sparse"]
        rows = global_rows(sparse, model.inputs.embeddings.row_offsets)
        assert (rows == 0).any()  # the batch pads some bags
        rows = rows.reshape(-1, rows.size(-1))
        for module, optimizer in ((bags, ours), (twin, theirs)):
            optimizer.zero_grad()
            torch.manual_seed(0)
            (module(rows) * torch.randn(rows.size(0), bags.embedding_dim)).sum().backward()
            optimizer.step()
    assert bags.weight.grad._nnz() > twin.weight.grad._nnz()  # padding lookups kept
    torch.testing.assert_close(bags.weight.detach(), twin.weight.detach(), rtol=0, atol=1e-6)
    assert not bags.weight.detach()[0].any()


def test_untouched_rows_stay_bit_identical_through_training() -> None:
    setup = zoo.create("dlrm", sparse_embeddings=True, batch_size=32)
    model = setup.model
    table = model.inputs.embeddings.bags.weight
    before = table.detach().clone()
    optimizer = make_optimizer(model)
    batches = setup.train_batches()
    seen = torch.zeros(table.size(0), dtype=torch.bool)
    for _ in range(3):
        batch = next(batches)
        rows = global_rows(batch["sparse"], model.inputs.embeddings.row_offsets)
        seen[rows.flatten()] = True
        zoo.training_step(setup, model, optimizer, batch)
        assert table.grad is None or table.grad.is_sparse
    changed = (table.detach() != before).any(1)
    seen[0] = False  # padding
    assert torch.equal(changed, seen)
    # AdamW holds no state for the table: the sparse path's memory win.
    assert all(p is not table for p in optimizer.dense.state)


@pytest.mark.parametrize("fused_tables", [False, True])
def test_state_dict_round_trip_resumes_identically(fused_tables: bool) -> None:
    config = OptimizerConfig(fused_tables=fused_tables)

    def run(resume: bool) -> torch.Tensor:
        setup = zoo.create("dlrm", sparse_embeddings=True, batch_size=32)
        optimizer = make_optimizer(setup.model, config)
        batches = [b for b, _ in zip(setup.train_batches(), range(4), strict=False)]
        for batch in batches[:2]:
            zoo.training_step(setup, setup.model, optimizer, batch)
        if resume:
            saved = (
                optimizer.state_dict(),
                {k: v.clone() for k, v in setup.model.state_dict().items()},
            )
            optimizer = make_optimizer(setup.model, config)
            setup.model.load_state_dict(saved[1])
            optimizer.load_state_dict(saved[0])
        for batch in batches[2:]:
            zoo.training_step(setup, setup.model, optimizer, batch)
        return setup.model.inputs.embeddings.bags.weight.detach().clone()

    torch.testing.assert_close(run(resume=True), run(resume=False), rtol=0, atol=0)


def test_sparse_tables_train_under_torch_compile() -> None:
    """One graph, no break: the sparse table gradient comes out of the compiled backward and
    the row-wise update runs after it, in `step()`."""
    eager = zoo.create("dlrm", sparse_embeddings=True, batch_size=32)
    compiled = zoo.create("dlrm", sparse_embeddings=True, batch_size=32)
    torch._dynamo.reset()
    model = torch.compile(compiled.model, fullgraph=True, backend="aot_eager")
    want = zoo.train(eager, 3, lr=3e-3)
    got = zoo.train(compiled, 3, lr=3e-3, model=model)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        compiled.model.inputs.embeddings.bags.weight, eager.model.inputs.embeddings.bags.weight
    )


def test_hstu_with_xl_tables_trains_under_inductor_and_autocast() -> None:
    """HSTU with the xl preset's options (a sparse item table, row-wise Adagrad, jagged
    batches) compiled by inductor under bf16 autocast, as bench/realized.py runs xl. Its
    table used to be looked up three times (history, targets, negatives): inductor turned
    the sum of the three sparse gradients into a fallback `aten.add` whose output it took
    for a dense tensor, and the first backward failed its `assert_size_stride`. Now the
    gradient comes out sparse, one entry per lookup, and agrees with eager's."""
    xl, data, _ = zoo.preset_config("hstu", "xl")
    assert xl.sparse_embeddings and data.layout == "jagged"
    options = dict(num_items=60, max_seq_len=8, embedding_dim=16, num_heads=2, num_layers=1,
                   num_negatives=8, num_clusters=4, batch_size=4)  # fmt: skip
    eager = zoo.create("hstu", "xl", **options)
    compiled = zoo.create("hstu", "xl", **options)
    batch = next(eager.train_batches())

    def grads(setup: zoo.ZooSetup, model: nn.Module) -> dict[str, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = setup.loss(model, batch)
        loss.backward()
        return {name: p.grad for name, p in setup.model.named_parameters()}

    want = grads(eager, eager.model)
    torch._dynamo.reset()
    # Scalar C++ kernels: a cold compile in ~15 s instead of ~50 s; the bug is not in them.
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        got = grads(compiled, torch.compile(compiled.model))
    table = got["item_embeddings.weight"]
    lookups = sum(batch[key].numel() for key in ("items", "targets", "negatives"))
    assert table.is_sparse and table._nnz() == lookups
    for name, grad in want.items():
        # bf16 autocast: inductor rounds elsewhere than eager, so directions are compared.
        a, b = got[name].to_dense().flatten().float(), grad.to_dense().flatten().float()
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999, name
    optimizer = make_optimizer(compiled.model, OptimizerConfig())
    assert embedding_update(compiled.model) == SPARSE_EMBEDDINGS
    optimizer.step()  # the row-wise update takes the compiled backward's sparse gradient
    assert torch.isfinite(compiled.model.item_embeddings.weight).all()


@pytest.mark.parametrize(
    ("dim", "dtype"), [(5, torch.float32), (128, torch.float32), (48, torch.bfloat16)]
)
def test_triton_kernel_matches_the_reference(dim: int, dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(dim)
    weight = torch.randn(40, dim, generator=g).to(dtype)
    state = torch.rand(40, generator=g)
    rows = torch.tensor([31, 0, 7, 39, 12])
    grads = torch.randn(5, dim, generator=g)
    want_weight, want_state = weight.clone(), state.clone()
    rowwise_adagrad_reference_(want_weight, want_state, rows, grads, lr=LR, eps=EPS)
    rowwise_adagrad_triton_(weight, state, rows, grads, lr=LR, eps=EPS)
    torch.testing.assert_close(state, want_state)
    torch.testing.assert_close(weight, want_weight)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(weight[untouched], want_weight[untouched])


def _lookups(g, rows, dim, *, hot=(), hot_count=0):
    """Lookups `[N]` over `rows` table rows (random, plus `hot_count` lookups of each `hot`
    row, shuffled) and their gradients `[N, dim]`."""
    ids = torch.cat([torch.randint(0, rows, (rows,), generator=g), *(
        torch.full((hot_count,), row) for row in hot
    )])  # fmt: skip
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    return ids, torch.randn(ids.numel(), dim, generator=g)


def test_sorted_dedupe_matches_coalesce_over_several_tables_and_steps() -> None:
    """The default path (no coalesce) against the first one (coalesce, then the distinct
    rows) and the hand-written reference: several tables, duplicates, empty gradients."""
    g = torch.Generator().manual_seed(3)
    shapes = [(12, 4), (30, 7), (5, 3)]
    starts = [torch.randn(shape, generator=g) for shape in shapes]
    tables = {d: [nn.Parameter(w.clone()) for w in starts] for d in ("sort", "coalesce")}
    optimizers = {d: RowWiseAdagrad(tables[d], lr=LR, eps=EPS, dedupe=d) for d in tables}
    want = [(w.clone(), torch.zeros(w.size(0))) for w in starts]
    for step in range(4):
        grads = []
        for i, (rows, dim) in enumerate(shapes):
            count = 0 if (step + i) % 3 == 0 else 3 * rows  # an empty gradient now and then
            ids = torch.randint(0, rows, (count,), generator=g)
            ids[: count // 2] = step % rows  # a hot row
            grads.append((ids, torch.randn(count, dim, generator=g)))
        for dedupe, params in tables.items():
            for table, (ids, values) in zip(params, grads, strict=True):
                table.grad = torch.sparse_coo_tensor(ids[None], values, table.shape)
                assert dedupe == "coalesce" or len(ids) == 0 or not table.grad.is_coalesced()
            optimizers[dedupe].step()
        for i, (ids, values) in enumerate(grads):
            want[i] = _reference(*want[i], list(zip(ids.tolist(), values, strict=True)))
    for i, (weight, state) in enumerate(want):
        for dedupe in tables:
            torch.testing.assert_close(tables[dedupe][i].detach(), weight)
            torch.testing.assert_close(optimizers[dedupe].state[tables[dedupe][i]]["sum"], state)


def test_dedupe_rows_sums_like_coalesce() -> None:
    g = torch.Generator().manual_seed(4)
    ids, values = _lookups(g, 50, 6, hot=(7, 0), hot_count=40)
    rows, summed = dedupe_rows(ids, values)
    want_rows, want_summed = coalesce_rows(torch.sparse_coo_tensor(ids[None], values, (50, 6)))
    assert torch.equal(rows, want_rows)
    torch.testing.assert_close(summed, want_summed)
    empty_rows, empty_summed = dedupe_rows(ids[:0], values[:0])
    assert empty_rows.numel() == 0 and empty_summed.shape == (0, 6)


@pytest.mark.parametrize(
    ("rows", "dim", "dtype", "hot_count"),
    [
        (40, 5, torch.float32, 0),  # few duplicates
        (3, 4, torch.float32, 3 * CHUNK + 5),  # rows spanning chunks
        (20, 128, torch.float32, CHUNK),
        (10, 48, torch.bfloat16, 7),
        (6, 2, torch.float32, 5 * CHUNK + 3),  # more chunk partials than HEADS (2 here)
        (7, 3, torch.float32, 2 * CHUNK),  # UPDATE_ROWS = 3: rows per update program
    ],
)
def test_triton_segment_update_matches_the_references(
    rows, dim, dtype, hot_count, monkeypatch
) -> None:
    """The sort + segment-sum kernels (no coalesce) against the pure-torch path and against
    coalescing first: the same table and accumulator, untouched rows bit-identical, and the
    same result on a second run (fixed order of sums)."""
    pytest.importorskip("triton")
    if hot_count > 3 * CHUNK + 5:  # a row's partials read HEADS at a time, several times
        monkeypatch.setattr(rowwise_adagrad, "HEADS", 2)
    if rows == 7:  # programs of the update kernel that see several lookups, the last ones
        monkeypatch.setattr(rowwise_adagrad, "UPDATE_ROWS", 3)  # past the end
    g = torch.Generator().manual_seed(rows * dim + hot_count)
    weight = torch.randn(rows, dim, generator=g).to(dtype)
    state = torch.rand(rows, generator=g)
    ids, values = _lookups(g, rows, dim, hot=(rows - 1, 0), hot_count=hot_count)
    ids = ids[ids != 1]  # a row never looked up
    values = values[: ids.numel()]
    results = []
    for update in ("triton", "triton", "reference", "coalesce"):
        w, s = weight.clone(), state.clone()
        if update == "triton":
            rowwise_adagrad_sparse_triton_(w, s, ids, values, lr=LR, eps=EPS)
        elif update == "reference":
            rowwise_adagrad_sparse_reference_(w, s, ids, values, lr=LR, eps=EPS)
        else:
            distinct, summed = coalesce_rows(torch.sparse_coo_tensor(ids[None], values, w.shape))
            rowwise_adagrad_reference_(w, s, distinct, summed, lr=LR, eps=EPS)
        results.append((w, s))
    (w, s), again, *references = results
    assert torch.equal(w, again[0]) and torch.equal(s, again[1])
    for want_w, want_s in references:  # the same sums, in another order
        torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w, want_w)
    assert torch.equal(w[1], weight[1]) and s[1] == state[1]


def test_triton_segment_update_of_a_model_gradient_and_of_nothing() -> None:
    """A real EmbeddingBag gradient (uncoalesced, padding left out) through the kernels,
    against coalescing it first; an empty gradient changes nothing."""
    pytest.importorskip("triton")
    setup = zoo.create("dlrm", sparse_embeddings=True, batch_size=16)
    setup.loss(setup.model, next(setup.train_batches())).backward()
    table = setup.model.inputs.embeddings.bags.weight
    assert not table.grad.is_coalesced()
    ids, values = lookup_rows(table.grad)
    assert ids.numel() > ids.unique().numel()  # duplicates
    state = torch.rand(table.size(0))
    got_w, got_s = table.detach().clone(), state.clone()
    rowwise_adagrad_sparse_triton_(got_w, got_s, ids, values, lr=LR, eps=EPS)
    want_w, want_s = table.detach().clone(), state.clone()
    rowwise_adagrad_reference_(want_w, want_s, *coalesce_rows(table.grad), lr=LR, eps=EPS)
    torch.testing.assert_close(got_s, want_s)
    torch.testing.assert_close(got_w, want_w)
    before = got_w.clone(), got_s.clone()
    rowwise_adagrad_sparse_triton_(got_w, got_s, ids[:0], values[:0], lr=LR, eps=EPS)
    assert torch.equal(got_w, before[0]) and torch.equal(got_s, before[1])
    with pytest.raises(ValueError, match="one gradient row per bag"):
        rowwise_adagrad_sparse_triton_(got_w, got_s, ids, values[:, :2], lr=LR, eps=EPS)


@pytest.mark.parametrize("bag", [1, 3])
def test_triton_kernels_read_one_gradient_per_bag_and_skip_the_padding_row(bag: int) -> None:
    """The fused path's form: one gradient row per bag of `bag` lookups, padding lookups
    (row 0) sorted with the rest but neither read nor updated; against the reference and
    against per-lookup gradients with the padding dropped, coalesced first."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(bag)
    weight, state = torch.randn(12, 6, generator=g), torch.rand(12, generator=g)
    rows = torch.randint(0, 12, (40, bag), generator=g)
    rows[::3, -1] = 0  # padding
    rows[1::4] = 5  # a hot row
    grad_out = torch.randn(40, 6, generator=g)
    results = []
    for update in (rowwise_adagrad_sparse_triton_, rowwise_adagrad_sparse_reference_):
        w, s = weight.clone(), state.clone()
        update(w, s, rows.flatten(), grad_out, lr=LR, eps=EPS, bag=bag, skip_row=0)
        results.append((w, s))
    flat, values = rows.flatten(), grad_out.repeat_interleave(bag, 0)
    keep = flat != 0
    want_w, want_s = weight.clone(), state.clone()
    with torch.sparse.check_sparse_tensor_invariants():
        lookups = torch.sparse_coo_tensor(flat[keep][None], values[keep], weight.shape)
    distinct, summed = coalesce_rows(lookups)
    rowwise_adagrad_reference_(want_w, want_s, distinct, summed, lr=LR, eps=EPS)
    for w, s in results:
        torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w, want_w)
        assert torch.equal(w[0], weight[0]) and s[0] == state[0]


def _train_fused(fused: bool, *, compiled: bool = False, steps: int = 3):
    setup = zoo.create("dlrm", sparse_embeddings=True, batch_size=32)
    optimizer = make_optimizer(setup.model, OptimizerConfig(lr=3e-3, fused_tables=fused))
    model = setup.model
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(setup.model, fullgraph=True, backend="aot_eager")
    before = setup.model.inputs.embeddings.bags.weight.detach().clone()
    losses = zoo.train(setup, steps, optimizer=optimizer, model=model)
    return setup, optimizer, losses, before


def test_fused_tables_train_like_the_step_path_eager_and_compiled() -> None:
    """The option: the table's update in the lookup's backward gives the same training as
    the update in `step()`, in eager mode and compiled as one graph; the table gets no
    gradient, the padding row never moves."""
    step_setup, _, want_losses, _ = _train_fused(False)
    want = step_setup.model.inputs.embeddings.bags.weight
    for compiled in (False, True):
        setup, optimizer, losses, before = _train_fused(True, compiled=compiled)
        embeddings = setup.model.inputs.embeddings
        assert embedding_update(setup.model) == FUSED_EMBEDDINGS and embeddings.fused
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(embeddings.bags.weight, want)
        assert embeddings.bags.weight.grad is None and embeddings.update_trigger.grad is None
        assert torch.equal(embeddings.bags.weight[0], before[0])
        state = optimizer.sparse.state[embeddings.bags.weight]["sum"]
        assert state.count_nonzero() > 0  # the accumulator the optimizer saves is the one used


def test_fused_tables_backward_runs_the_triton_kernels(monkeypatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr(
        rowwise_adagrad, "rowwise_adagrad_sparse_", rowwise_adagrad_sparse_triton_
    )  # what CUDA takes; here in the interpreter
    setup, _, losses, _ = _train_fused(True, steps=2)
    step_setup, _, want_losses, _ = _train_fused(False, steps=2)
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        setup.model.inputs.embeddings.bags.weight, step_setup.model.inputs.embeddings.bags.weight
    )


def test_fused_tables_need_sparse_feature_embeddings() -> None:
    with pytest.raises(ValueError, match="fused_tables"):
        make_optimizer(zoo.create("dlrm").model, OptimizerConfig(fused_tables=True))
    with pytest.raises(ValueError, match="fused_tables"):
        make_optimizer(
            zoo.create("hstu", sparse_embeddings=True).model, OptimizerConfig(fused_tables=True)
        )


_COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loka.zoo.rowwise_adagrad import _kernel, _segment_kernels
target, options = GPUTarget("cuda", 90, 32), {"num_warps": 4}
for table in ("*fp32", "*bf16"):
    signature = dict(weight_ptr=table, state_ptr="*fp32", rows_ptr="*i64", grads_ptr="*fp32",
                     dim="i32", weight_stride="i64", grad_stride="i64", lr="fp32", eps="fp32",
                     BLOCK="constexpr")
    source = ASTSource(_kernel(), signature, {"BLOCK": 256})
    triton.compile(source, target=target, options=options)
    partials, update = _segment_kernels()
    signature = dict(sorted_ptr="*i32", order_ptr="*i64", values_ptr=table, partial_ptr="*fp32",
                     n="i64", dim="i32", value_stride="i64", bag="i64", skip_row="i64",
                     CHUNK="constexpr", BLOCK="constexpr")
    triton.compile(ASTSource(partials, signature, {"CHUNK": 32, "BLOCK": 128}), target=target,
                   options={"num_warps": 1})
    signature = dict(weight_ptr=table, state_ptr="*fp32", sorted_ptr="*i32", ends_ptr="*i64",
                     partial_ptr="*fp32", n="i64", dim="i32", weight_stride="i64", lr="fp32",
                     eps="fp32", skip_row="i64", CHUNK="constexpr", HEADS="constexpr", ROWS="constexpr",
                     BLOCK="constexpr")
    for rows in (1, 8):
        constants = {"CHUNK": 32, "HEADS": 32, "ROWS": rows, "BLOCK": 128}
        triton.compile(ASTSource(update, signature, constants), target=target, options=options)
    print("OK", table)
"""


def test_triton_kernel_compiles_for_hopper() -> None:
    """What only the compiler sees (types, lowering), checked without a GPU: a subprocess,
    since this session's kernel runs in the interpreter."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton build ships no ptxas to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["OK", "*fp32", "OK", "*bf16"]
