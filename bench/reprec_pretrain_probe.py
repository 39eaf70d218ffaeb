"""Issue 19 probe: pretrain REPREC's small backbone on a 5-core file under a wall-clock budget and
log, every step, what `pretrain_backbone` hides: the answer loss of the next-item question and
of the membership questions apart, the answer probability mass on " Yes"/" No", the gradient
norm; then the context sensitivity (untrained injector) and zero-shot HR@10 as in
bench/results/reprec_issue19_backbone.py.txt. CPU, one thread.

    python bench/reprec_pretrain_probe.py DATA_FILE OUT.json '{"lr": 1e-3, ...}'

The logged answer losses are always over the whole vocabulary. JSON keys (DEFAULTS below):
- users: a subset of that many users (`random.Random(0).sample` of the file's lines, items
  renumbered by first appearance: 3000 of Beauty.txt give the set of
  bench/results/reprec_issue19_*);
- package: a dict of PretrainConfig fields: run loka.reprec's own `pretrain_backbone` with it
  instead of this loop (its curve: the loss and answer loss of every step);
- answer_loss: "full" (cross-entropy over the vocabulary), "yesno" (over " Yes"/" No"
  alone) or "both" (their sum);
- sparse_head: the vocabulary head only at positions whose target is an item or an answer
  (the template words are not predicted), as PretrainConfig(predict="items");
- trim: cut each batch's padding (a smaller `block` shortens long histories);
- clip: max gradient norm (0: none);
- seconds (budget), hidden, init, mlp, lr, answer_weight, batch_size, block, questions,
  next_item, warmup_steps, eval_users, seed.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from harness import metadata, write_json
from torch import nn

from loka.reprec.backbone import (
    BackboneConfig,
    PretrainConfig,
    build_backbone,
    pretrain_backbone,
    pretraining_blocks,
)
from loka.reprec.data import load_dataset
from loka.reprec.evaluate import grouped_metrics, score_eval_set
from loka.reprec.examples import eval_set, sample_users
from loka.reprec.injector import InjectorConfig, UserEmbeddingInjector
from loka.reprec.model import PromptScorer, context_sensitivity
from loka.reprec.prompts import PromptEncoder
from loka.reprec.tokenizer import build_item_tokenizer

DEFAULTS = dict(
    seconds=420,
    hidden=64,
    init=0.1,
    mlp=2.0,
    lr=1e-3,
    answer_weight=1000.0,
    batch_size=16,
    block=128,
    questions=4,
    next_item=True,
    warmup_steps=46,
    clip=0.0,
    trim=False,
    eval_users=200,
    seed=0,
    log_every=25,
    answer_loss="full",
    sparse_head=False,
    package=None,
)


class Stub(nn.Module):
    config = SimpleNamespace(embedding_dim=32)

    def user_embedding(self, h: torch.Tensor) -> torch.Tensor:
        table = torch.randn(997, 32, generator=torch.Generator().manual_seed(0))
        return table[(h * torch.arange(1, h.size(1) + 1)).sum(1) % 997]


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    path, out = argv[0], argv[1]
    cfg = {**DEFAULTS, **(json.loads(argv[2]) if len(argv) > 2 else {})}
    if cfg["users"]:  # random.Random(0).sample of the file's lines, items renumbered
        lines = [line for line in Path(path).read_text().split("\n") if line.strip()]
        items: dict[str, int] = {}
        text = "".join(
            " ".join(
                [str(u + 1), *(str(items.setdefault(i, len(items) + 1)) for i in line.split()[1:])]
            )
            + "\n"
            for u, line in enumerate(random.Random(0).sample(lines, cfg["users"]))
        )
        path = str(Path(tempfile.mkdtemp()) / Path(path).name)
        Path(path).write_text(text)
        cfg["subset_md5"] = hashlib.md5(text.encode()).hexdigest()
    data = load_dataset(path)
    tok = build_item_tokenizer(data.num_items)
    prompts = PromptEncoder(tok, data.num_items, history_items=50)
    hidden = int(cfg["hidden"])
    llm = build_backbone(
        BackboneConfig(
            hidden_size=hidden,
            num_layers=2,
            num_heads=2,
            intermediate_size=int(hidden * cfg["mlp"]),
            initializer_range=cfg["init"],
        ),
        tok,
    )
    opt = torch.optim.AdamW(llm.parameters(), lr=cfg["lr"], weight_decay=0.01)
    yes, no = prompts.yes_id, prompts.no_id
    answer_ids = torch.tensor([yes, no])
    item_tokens = prompts.item_ids[1:, -1]
    curve: list[dict] = []
    t0, step, epoch = time.time(), 0, 0
    llm.train()
    if cfg["package"]:  # loka.reprec's own pretrain_backbone with PretrainConfig(**cfg["package"])
        answers: list[float] = []
        times: list[float] = []
        losses = pretrain_backbone(
            llm,
            prompts,
            data,
            PretrainConfig(**cfg["package"]),
            answer_losses=answers,
            on_step=lambda s, n, v: times.append(round(time.time() - t0, 1)),
        )
        curve = [
            dict(step=i, t=t, loss=round(v, 4), answer=round(a, 4))
            for i, (t, v, a) in enumerate(zip(times, losses, answers, strict=False))
        ]
        for i in range(0, len(curve), cfg["log_every"]):
            w = curve[i : i + cfg["log_every"]]
            print(
                f"[{w[-1]['t']:.0f}s] step {i} loss {np.mean([c['loss'] for c in w]):.3f} "
                f"answer {np.mean([c['answer'] for c in w]):.3f}",
                flush=True,
            )
        step = len(curve)
    while not cfg["package"] and time.time() - t0 < cfg["seconds"]:
        rows = pretraining_blocks(
            prompts,
            data,
            block=cfg["block"],
            questions=cfg["questions"],
            next_item=cfg["next_item"],
            seed=cfg["seed"],
            epoch=epoch,
        )
        epoch += 1
        for b in range(len(rows) // cfg["batch_size"]):
            if time.time() - t0 >= cfg["seconds"]:
                break
            ids = rows[b * cfg["batch_size"] : (b + 1) * cfg["batch_size"]]
            if cfg["trim"]:
                ids = ids[:, : int((ids != prompts.pad_id).sum(1).max())]
            targets = ids[:, 1:]
            answer = torch.isin(targets, answer_ids)
            keep = targets != prompts.pad_id
            if cfg[
                "sparse_head"
            ]:  # the vocabulary head only where the target is an item or an answer
                keep = keep & (answer | torch.isin(targets, item_tokens))
                states = llm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
                kept = llm.get_output_embeddings()(states[keep]).float()
            else:
                kept = llm(input_ids=ids, use_cache=False).logits[:, :-1].float()[keep]
            token_k = F.cross_entropy(kept, targets[keep], reduction="none")
            answer_k = answer[keep]
            logits_a = kept[answer_k]
            full = token_k[answer_k].detach()
            if cfg["answer_loss"] != "full":  # the answer's Yes/No choice alone (+ full CE: "both")
                pair = F.cross_entropy(
                    logits_a[:, [yes, no]], (targets[answer] == no).long(), reduction="none"
                )
                token_k = token_k.masked_scatter(
                    answer_k, pair + (token_k[answer_k] if cfg["answer_loss"] == "both" else 0)
                )
            weight = 1.0 + (cfg["answer_weight"] - 1.0) * answer_k.float()
            loss = (token_k * weight).sum() / weight.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = float(
                torch.nn.utils.clip_grad_norm_(
                    llm.parameters(), cfg["clip"] if cfg["clip"] else float("inf")
                )
            )
            lr = cfg["lr"] * min(1.0, (step + 1) / max(1, cfg["warmup_steps"]))
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            with torch.no_grad():
                order = answer.long().cumsum(1)  # 1 = first question of the row
                lp = F.log_softmax(logits_a, -1)
                mass = float((lp[:, yes].exp() + lp[:, no].exp()).mean())
                restricted = float(
                    F.cross_entropy(logits_a[:, [yes, no]], (targets[answer] == no).long())
                )
                tok_ans = full
                first = (
                    (order[answer] == 1)
                    if cfg["next_item"]
                    else torch.zeros_like(tok_ans, dtype=torch.bool)
                )
                hist = ~answer_k
                curve.append(
                    dict(
                        step=step,
                        t=round(time.time() - t0, 1),
                        width=int(ids.size(1)),
                        loss=round(float(loss), 4),
                        grad_norm=round(gnorm, 4),
                        lr=lr,
                        answer=round(float(tok_ans.mean()), 4),
                        next_q=round(float(tok_ans[first].mean()), 4)
                        if bool(first.any())
                        else None,
                        member_q=round(float(tok_ans[~first].mean()), 4)
                        if bool((~first).any())
                        else None,
                        yes_no_mass=round(mass, 4),
                        restricted=round(restricted, 4),
                        history=round(float(token_k[hist].mean()), 4),
                    )
                )
            if step % cfg["log_every"] == 0:
                w = curve[-cfg["log_every"] :]
                mean = lambda k, w=w: np.mean([c[k] for c in w if c[k] is not None])  # noqa: E731
                print(
                    f"[{curve[-1]['t']:.0f}s] step {step} w{ids.size(1)} loss {mean('loss'):.3f} "
                    f"ans {mean('answer'):.3f} next {mean('next_q') if cfg['next_item'] else float('nan'):.3f} "
                    f"member {mean('member_q'):.3f} restr {mean('restricted'):.3f} mass {mean('yes_no_mass'):.3f} "
                    f"gnorm {mean('grad_norm'):.2f} (max {max(c['grad_norm'] for c in w):.2f}) hist {mean('history'):.2f}",
                    flush=True,
                )
            step += 1
    llm.eval().requires_grad_(False)
    train_s = time.time() - t0
    result = dict(config=cfg, steps=step, epochs_started=epoch, train_seconds=round(train_s, 1))
    last = curve[-50:]
    for k in ("answer", "next_q", "member_q", "restricted", "yes_no_mass", "grad_norm"):
        vals = [c[k] for c in last if c.get(k) is not None]
        result[f"last50_{k}"] = round(float(np.mean(vals)), 4) if vals else None
    if cfg["eval_users"]:
        scale = llm.get_input_embeddings().weight.pow(2).mean().sqrt().item()
        torch.manual_seed(0)
        inj = UserEmbeddingInjector(
            InjectorConfig(
                user_dim=32, hidden_size=hidden, num_tokens=6, mlp_dim=64, output_scale=scale
            )
        )
        users = sample_users(data, cfg["eval_users"], seed=0)
        ev = eval_set(
            data, width=50, users=users, num_negatives=200, negative_sampling="mixed", seed=0
        )
        sens = context_sensitivity(
            PromptScorer(llm, prompts, injector=inj, user_encoder=Stub()), ev
        )
        zs = score_eval_set(
            PromptScorer(llm, prompts), ev, device=torch.device("cpu"), max_prompts=2048
        )
        m = grouped_metrics(zs, ev.activity)["all"]
        result.update(
            context_sensitivity=round(sens, 4),
            zero_shot_hr10=round(m["hr@10"], 4),
            zero_shot_ndcg10=round(m["ndcg@10"], 4),
            chance_hr10=round(10 / 201, 4),
        )
    result.update(
        meta=metadata(
            "cpu",
            transformers=__import__("transformers").__version__,
            threads=torch.get_num_threads(),
        ),
        total_seconds=round(time.time() - t0, 1),
        curve=curve,
    )
    print("RESULT", json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
    write_json(out, result, indent=None)


if __name__ == "__main__":
    main(sys.argv[1:])
