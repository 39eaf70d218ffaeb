"""LoRDBA on the GPU: binary-sign adapters against fp16-class LoRA, all in one run.

Sections (hidden 4096, rank 16 by default; bf16 activations and base weights):
- check:   the Triton sign-GEMM path of LoRDBALinear against its pure-torch reference on the
           device (forward, inference addmm path with the two kernels and with the fused
           one-launch kernel, the fused path over an opaque base, the GEMM-epilogue path in
           bf16 over the plain base and over an Fp8WeightOnlyLinear of it, backward: dx and
           every adapter gradient), at hidden-size and awkward shapes. Speed numbers mean
           nothing if this fails.
- bytes:   adapter bytes, LoRDBA (packed signs + fp16 scales; the default without the input
           scale q, and with it) against an fp16 LoRA of the same rank: formula and files.
- fit:     what q buys: the fit error of LoRDBA, without and with q, on LoRA factors
           (Gaussian ones, and LoRAs trained with AdamW on inputs whose channels have equal
           or lognormal scales, the target defined on raw or on normalized inputs).
- prefill: forward time per token count (512..8192) of the base linear alone, base + 16-bit
           LoRA unmerged (peft's form, and a fused-addmm form), base + LoRDBA unmerged
           (nn.Linear base: adapter output fed to the base GEMM's addmm; with q; an opaque
           base: add fused into the up-projection), and the LoRDBA adapter alone; each LoRDBA
           variant with the two sign-GEMM kernels and with the fused one-launch kernel
           (`*_fused`, LoRDBAConfig.fused); and the GEMM-epilogue kernel (linear_sign_up):
           the base alone in its base-only mode (`base_epilogue`, and `base_fp8_epilogue`
           over the FP8 codes of an Fp8WeightOnlyLinear of the base, beside that base's own
           forward `base_fp8`) and base + LoRDBA with the up-projection in its epilogue
           (`lordba_epilogue`, `lordba_fp8_epilogue`; `lordba_fp8_fused` is the one-launch
           adapter over that base's own forward), with ratios to the base each stands on
           (`*_vs_own_base`: the kernel's base-only mode for the epilogue variants). Median of triton.testing.do_bench (eager) and
           do_bench_cudagraph (GPU time), and the host time per call (Python and launches).
- model:   prefill of a whole decoder (a Llama-shaped transformers.LlamaModel, random
           weights: hidden 4096, FFN 11008, 4 layers by default, no LM head) over frozen
           bases: plain bf16, torchao int8 and FP8 weight-only (and LoKA's
           Fp8WeightOnlyLinear); the base model alone, then every linear adapted by LoRDBA
           rank 16 with the two kernels (unfused), with the fused kernel and as two cuBLAS
           GEMMs on dense factors (`lordba_dense`, LoRDBAConfig.dense_inference), side by side at
           512/2048/8192 tokens: times, ratios to the base model, the path each adapter took
           and the fused output's error against the unfused one. Over the bases the
           GEMM-epilogue kernel covers (plain, loka_fp8) also the base model on that kernel's
           base-only mode (`base_epilogue`) and the adapted model on the epilogue path
           (`lordba_epilogue`), with ratios to `base_epilogue` (`*_vs_own_base`).
- train:   one training step (forward, backward with dx, AdamW) of base + LoRA (fp32
           masters, bf16 compute) and base + LoRDBA (fp32 latents and scales): peak memory
           above what is resident before the step, adapter state bytes, step time; and the
           forward + backward alone (eager, CUDA graph and host time).

    python bench/lordba.py --smoke    # CPU (Triton interpreter) or GPU, tiny sizes, < 1 min
    python bench/lordba.py            # one H200, about 5 min (mostly autotuning)
    python bench/lordba.py --sections check,prefill,model   # issue 19's prefill numbers
    python bench/lordba.py --sections bytes,fit   # no GPU needed (CPU: minutes)
Results in --out (default $OUT, else bench/results/): lordba_<mode>_<utc>.json (metadata,
every raw record, the summary), lordba_prefill_<mode>_<utc>.csv and lordba_model_<mode>_<utc>.csv.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from harness import Budget, metadata, parser, write_csv, write_json
from harness import stamp as utc_stamp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)  # --out, --budget-s (240 s; smoke 60)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: Triton interpreter)")
    p.add_argument("--hidden", type=int, default=None, help="K = N (4096; smoke 64)")
    p.add_argument("--rank", type=int, default=None, help="adapter rank (16; smoke 4)")
    p.add_argument("--tokens", default=None, help="prefill token counts (512,...,8192; smoke 8,24)")
    p.add_argument("--train-tokens", default=None, help="training tokens (4096,8192; smoke 16)")
    p.add_argument("--model-bases", default=None,
                   help=f"bases of the model section, of {sorted(MODEL_BASES)} "
                   "(plain,int8,fp8,loka_fp8; smoke plain,int8,loka_fp8)")  # fmt: skip
    p.add_argument(
        "--model-tokens", default=None, help="model prefill tokens (512,2048,8192; smoke 16)"
    )
    p.add_argument(
        "--model-hidden", type=int, default=None, help="model hidden size (4096; smoke 64)"
    )
    p.add_argument("--model-ffn", type=int, default=None, help="model FFN size (11008; smoke 96)")
    p.add_argument("--model-layers", type=int, default=None, help="decoder layers (4; smoke 1)")
    p.add_argument("--sections", default="check,bytes,fit,prefill,model,train")
    p.add_argument("--no-autotune", action="store_true", help="one heuristic tile per kernel")
    return p.parse_args(argv)


CPU_SECTIONS = {"bytes", "fit"}  # device-independent numbers
SECTION_NAMES = ("check", "bytes", "fit", "prefill", "model", "train")
# Frozen bases of the model section: the plain weights, torchao's weight-only int8 and FP8,
# LoKA's FP8 weight-only linear (dequantizes its whole weight at every call: a reference; its
# FP8 codes are what the GEMM-epilogue kernel reads).
MODEL_BASES = ("plain", "int8", "fp8", "loka_fp8")
EPILOGUE_BASES = ("plain", "loka_fp8")  # the bases linear_sign_up covers

import torch  # noqa: E402

if not torch.cuda.is_available():  # a CPU runs --smoke, "bytes" and "fit" in the interpreter,
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before any @triton.jit is created

import safetensors.torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from torch import nn  # noqa: E402

from loka.lordba import (  # noqa: E402
    Fp8WeightOnlyLinear,
    LoRDBAConfig,
    LoRDBALinear,
    convert_to_lordba,
    fit_lora,
    lordba_footprint,
    quantize_fp8_weights,
    save_lordba,
)
from loka.lordba.convert import replace_modules  # noqa: E402
from loka.lordba.kernels import sign_adapter, sign_down, sign_up  # noqa: E402
from loka.lordba.module import epilogue_base_forward  # noqa: E402
from loka.lordba.testing import OpaqueBase  # noqa: E402  (LoRDBA adds into its output)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = DEVICE.type == "cuda"
DTYPE = torch.bfloat16 if CUDA else torch.float32
# The GEMM-epilogue path takes bf16/fp16 inputs only (float32 keeps cuBLAS): its variants run
# in bf16 on a CPU too (on the GPU that is DTYPE).
EPILOGUE_DTYPE = DTYPE if DTYPE in (torch.bfloat16, torch.float16) else torch.bfloat16
HOST_CALLS = 20
PREFILL_AIM = 1.08  # the paper's "at most 8% prefill overhead at rank 16, unmerged"
# bf16 GEMM [M, 4096] x [4096, 4096] on the H200 (shared/anchors/h200_gemm_bf16_vs_fp8_2026-11-29.csv,
# do_bench median): this run's base should land near these.
ANCHOR_BF16_MS = {2048: 0.0942, 8192: 0.3870}
BYTES_AIM = 10.0


def configure(args: argparse.Namespace) -> None:
    """Set the run's globals from its arguments (main() does; importing sets the full run's)."""
    global ARGS, SECTIONS, MODE, HIDDEN, RANK, TOKENS, TRAIN_TOKENS, FIT_STEPS, BUDGET_S, BUDGET
    global MODEL
    ARGS = args
    SECTIONS = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(SECTIONS) - set(SECTION_NAMES)
    if unknown:
        raise SystemExit(f"unknown --sections {sorted(unknown)}")
    MODE = "smoke" if args.smoke else ("full" if CUDA else "cpu")
    HIDDEN = args.hidden or (64 if args.smoke else 4096)
    RANK = args.rank or (4 if args.smoke else 16)
    default_tokens = "8,24" if args.smoke else "512,1024,2048,4096,8192"
    TOKENS = [int(t) for t in (args.tokens or default_tokens).split(",")]
    default_train = "16" if args.smoke else "4096,8192"
    TRAIN_TOKENS = [int(t) for t in (args.train_tokens or default_train).split(",")]
    FIT_STEPS = 20 if args.smoke else 200  # training steps of the LoRAs the fit section converts
    default_bases = "plain,int8,loka_fp8" if args.smoke else "plain,int8,fp8,loka_fp8"
    MODEL = ModelShape(
        bases=[b.strip() for b in (args.model_bases or default_bases).split(",") if b.strip()],
        tokens=[
            int(t)
            for t in (args.model_tokens or ("16" if args.smoke else "512,2048,8192")).split(",")
        ],
        hidden=args.model_hidden or (64 if args.smoke else 4096),
        ffn=args.model_ffn or (96 if args.smoke else 11008),
        layers=args.model_layers or (1 if args.smoke else 4),
    )
    unknown_bases = set(MODEL.bases) - set(MODEL_BASES)
    if unknown_bases:
        raise SystemExit(f"unknown --model-bases {sorted(unknown_bases)}; known: {MODEL_BASES}")
    BUDGET_S = args.budget_s or (90.0 if args.smoke else 480.0)
    BUDGET = Budget(BUDGET_S)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The model section's decoder: heads of 128 features (at least one), vocabulary 1024."""

    bases: list[str]
    tokens: list[int]
    hidden: int
    ffn: int
    layers: int
    vocab: int = 1024

    @property
    def heads(self) -> int:
        return max(1, self.hidden // 128)


configure(parse_args([]))


def elapsed() -> float:
    return BUDGET.elapsed()


def over_budget(share: float) -> bool:
    """True once the run has spent ``share`` of the budget (later work is recorded skipped)."""
    return elapsed() > share * BUDGET_S


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------


def host_ms(fn) -> float:
    """Host milliseconds per call (Python, checks, launches) while the GPU queue absorbs the
    work: where eager time exceeds this and the graph time, the GPU is the bottleneck."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed_ms = (time.perf_counter() - t0) * 1e3 / HOST_CALLS
    torch.cuda.synchronize()
    return elapsed_ms


def time_ms(fn) -> dict[str, float | None]:
    """Median milliseconds: eager (do_bench), GPU time under a CUDA graph, host time."""
    if not CUDA:
        fn()
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e3)
        return {"eager_ms": sorted(runs)[1], "graph_ms": None, "host_ms": None}
    eager = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    host = host_ms(fn)
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            graph = triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
    except Exception as error:  # a path that cannot be captured still has its eager time
        print(f"  (no CUDA-graph time: {type(error).__name__}: {error})")
        graph = None
    return {"eager_ms": eager, "graph_ms": graph, "host_ms": host}


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


class EpilogueBase(nn.Module):
    """A base run through the GEMM-epilogue kernel's base-only mode (``linear_sign_up`` with no
    adapter): what ``lordba_epilogue`` stands on, timed on the same kernel."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base

    def forward(self, x):
        return epilogue_base_forward(self.base, x)


def in_dtype(linear: nn.Linear, dtype: torch.dtype) -> nn.Linear:
    """``linear`` itself when its weight is of ``dtype``, else a copy cast to it."""
    return linear if linear.weight.dtype == dtype else copy.deepcopy(linear).to(dtype)


def make_base(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    base = nn.Linear(HIDDEN, HIDDEN, bias=False, device=DEVICE, dtype=DTYPE)
    base.weight.requires_grad_(False)
    return base


def trained_like(module: LoRDBALinear, seed: int = 1) -> LoRDBALinear:
    """Nonzero scales and random latents, as after training (p = 0 at init would hide work)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    scale = 1 / math.sqrt(module.in_features)
    with torch.no_grad():
        for param in (module.scale_in, module.scale_rank, module.scale_out):
            if param is not None:
                param.copy_((torch.rand(param.shape, generator=gen) + 0.5) * scale)
        module.latent_a.copy_(torch.randn(module.latent_a.shape, generator=gen))
        module.latent_b.copy_(torch.randn(module.latent_b.shape, generator=gen))
    return module


def make_lordba(
    base: nn.Module,
    input_scale: bool = LoRDBAConfig.input_scale,
    backend: str = "triton",
    fused: bool = False,
) -> LoRDBALinear:
    config = LoRDBAConfig(rank=RANK, input_scale=input_scale, backend=backend, fused=fused)
    return trained_like(LoRDBALinear(base, config))


def twin(module: LoRDBALinear, base: nn.Module | None = None, **config) -> LoRDBALinear:
    """A module with ``module``'s adapter (latents, scales, extra state) over ``base`` (default:
    the same base), its config changed by ``config`` (e.g. ``fused=True``, ``backend="torch"``)."""
    new = LoRDBALinear(base or module.base, dataclasses.replace(module.config, **config))
    adapter = {k: v for k, v in module.state_dict().items() if not k.startswith("base.")}
    new.load_state_dict(adapter, strict=False)
    for name, param in new.named_parameters():
        if not name.startswith("base."):  # the base stays frozen
            param.requires_grad_(module.get_parameter(name).requires_grad)
    return new


def lora_factors(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, float]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = (torch.randn(RANK, HIDDEN, generator=gen) / math.sqrt(HIDDEN)).to(DEVICE, DTYPE)
    b = (torch.randn(HIDDEN, RANK, generator=gen) / math.sqrt(RANK)).to(DEVICE, DTYPE)
    return a, b, 2.0  # scaling alpha / r


# --------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------


def relative_error(actual: torch.Tensor | None, expected: torch.Tensor | None) -> float:
    if actual is None or expected is None:
        return 0.0 if actual is expected else math.inf
    scale = expected.detach().float().abs().max().clamp_min(1e-12)
    return float((actual.detach().float() - expected.detach().float()).abs().max() / scale)


def check_section() -> list[dict]:
    """Triton path vs the pure-torch path of the same module, on the device."""
    shapes = (  # M, K, N, rank, input scale q
        [(5, 40, 36, 3, False), (5, 40, 36, 3, True)]
        if ARGS.smoke
        else [
            (1, 4096, 4096, 16, False),
            (37, 1000, 1032, 5, False),
            (37, 1000, 1032, 5, True),
            (512, 4096, 4096, 16, False),
            (512, 4096, 4096, 16, True),
        ]
    )
    tolerance = 2e-2 if CUDA else 1e-4  # bf16 on the GPU, float32 on CPU
    records = []
    for rows, k, n, rank, input_scale in shapes:
        torch.manual_seed(rows)
        base = nn.Linear(k, n, device=DEVICE, dtype=DTYPE)
        config = LoRDBAConfig(rank=rank, input_scale=input_scale, backend="triton", fused=False)
        kernels = trained_like(LoRDBALinear(base, config))
        reference = copy.deepcopy(kernels)
        reference.config = dataclasses.replace(kernels.config, backend="torch")
        x = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
        grad = torch.randn(rows, n, device=DEVICE, dtype=DTYPE)
        results = []
        for module in (kernels, reference):
            xg = x.clone().requires_grad_(True)
            out = module(xg)
            out.backward(grad)
            with torch.no_grad():
                inference = module(x)  # nn.Linear base: the addmm path, two kernels
                # The fused one-launch kernel (the reference has none: its two ops again),
                # into addmm and over an opaque base (added into the base's output).
                fused = twin(module, fused=True)
                opaque = twin(module, OpaqueBase(module.base), fused=True)
                if module is kernels:  # must be the fused kernel, else this checks nothing
                    paths = {"fused": fused.forward_path(x), "opaque": opaque.forward_path(x)}
                inference_fused, inference_opaque = fused(x), opaque(x)
            grads = {name: p.grad for name, p in module.named_parameters() if p.requires_grad}
            results.append(
                {
                    "out": out,
                    "inference": inference,
                    "inference_fused": inference_fused,
                    "inference_opaque_fused": inference_opaque,
                    "dx": xg.grad,
                    **grads,
                }
            )
        errors = {key: relative_error(results[0][key], results[1][key]) for key in results[1]}
        worst = max(errors.values())
        if paths != {"fused": "addmm_fused", "opaque": "base_fused"}:
            worst = math.inf  # the fused kernel did not run: a failed check, not a passed one
        epilogue, epilogue_paths = epilogue_errors(kernels, x)
        epilogue_worst = max(epilogue.values())
        if set(epilogue_paths.values()) != {"gemm_epilogue"}:
            epilogue_worst = math.inf  # the GEMM-epilogue kernel did not run
        ok = worst <= tolerance and epilogue_worst <= EPILOGUE_TOLERANCE
        records.append(
            {
                "M": rows,
                "K": k,
                "N": n,
                "rank": rank,
                "input_scale": input_scale,
                "dtype": str(DTYPE),
                "max_rel_error": worst,
                "errors": errors,
                "fused_paths": paths,
                "epilogue_max_rel_error": epilogue_worst,
                "epilogue_errors": epilogue,
                "epilogue_paths": epilogue_paths,
                "epilogue_tolerance": EPILOGUE_TOLERANCE,
                "ok": ok,
                "tolerance": tolerance,
            }
        )
        print(
            f"  check M={rows} K={k} N={n} r={rank} q={input_scale}: max rel error "
            f"{worst:.2e}, GEMM epilogue ({EPILOGUE_DTYPE}) {epilogue_worst:.2e} "
            f"({'ok' if ok else 'FAIL'})"
        )
    return records


EPILOGUE_TOLERANCE = 2e-2  # the GEMM-epilogue check runs in bf16 everywhere


def epilogue_errors(module: LoRDBALinear, x: torch.Tensor) -> tuple[dict, dict]:
    """The GEMM-epilogue path (bf16) with ``module``'s adapter over its base as a plain bf16
    linear and as an Fp8WeightOnlyLinear of it, against the same on the pure-torch path;
    returns the relative errors and the paths the Triton modules took."""
    plain = in_dtype(module.base, EPILOGUE_DTYPE)
    bases = {"epilogue": plain, "epilogue_fp8": Fp8WeightOnlyLinear.from_linear(plain)}
    x = x.to(EPILOGUE_DTYPE)
    errors, paths = {}, {}
    with torch.no_grad():
        for name, base in bases.items():
            fast = twin(module, base, backend="triton", gemm_epilogue=True)
            reference = twin(module, base, backend="torch")
            paths[name] = fast.forward_path(x)
            errors[f"inference_{name}"] = relative_error(fast(x), reference(x))
    return errors, paths


def bytes_section(tmp: Path) -> list[dict]:
    records = []
    a, b, _ = lora_factors()
    lora_path = tmp / "lora_fp16.safetensors"
    safetensors.torch.save_file(
        {"lora_A": a.half().cpu(), "lora_B": b.half().cpu()}, str(lora_path)
    )
    for input_scale in (False, True):
        footprint = lordba_footprint(HIDDEN, HIDDEN, RANK, input_scale=input_scale)
        module = make_lordba(make_base(), input_scale=input_scale)
        path = tmp / f"lordba_{input_scale}.safetensors"
        save_lordba(module, path)
        records.append(
            {
                "K": HIDDEN,
                "N": HIDDEN,
                "rank": RANK,
                "input_scale": input_scale,
                "lordba_bytes": footprint.lordba_bytes,
                "lora_fp16_bytes": footprint.lora_fp16_bytes,
                "ratio": footprint.ratio,
                "lordba_file_bytes": path.stat().st_size,
                "lora_fp16_file_bytes": lora_path.stat().st_size,
                "file_ratio": lora_path.stat().st_size / path.stat().st_size,
            }
        )
    return records


def trained_lora(channel_sigma: float, normalized_target: bool, seed: int) -> tuple[dict, tuple]:
    """A rank-RANK LoRA (scaling 2, peft's init, AdamW) trained to reproduce a random
    rank-RANK map on inputs whose channel RMS ``c`` is lognormal(channel_sigma): ``y = T x``,
    or ``y = T (x / c)`` (a map defined on normalized features, as with raw dense features of
    different units), which the LoRA can only express with A's columns scaled by ``1 / c``.
    Returns the relative losses and the factors."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    channels = torch.exp(channel_sigma * torch.randn(HIDDEN, generator=gen)).to(DEVICE)
    target_b = (torch.randn(HIDDEN, RANK, generator=gen) / math.sqrt(RANK)).to(DEVICE)
    target_a = (torch.randn(RANK, HIDDEN, generator=gen) / math.sqrt(HIDDEN)).to(DEVICE)
    if normalized_target:
        target_a = target_a / channels
    bound = 1 / math.sqrt(HIDDEN)
    a = nn.Parameter(((torch.rand(RANK, HIDDEN, generator=gen) * 2 - 1) * bound).to(DEVICE))
    b = nn.Parameter(torch.zeros(HIDDEN, RANK, device=DEVICE))
    optimizer = torch.optim.AdamW([a, b], lr=1e-3)
    inputs = torch.Generator(device=DEVICE).manual_seed(seed)
    losses = []
    for _ in range(FIT_STEPS):
        x = torch.randn(256, HIDDEN, device=DEVICE, generator=inputs) * channels
        y = (x @ target_a.T) @ target_b.T
        loss = ((x @ a.T) @ b.T * 2.0 - y).square().mean() / y.square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    factors = (a.detach().float().cpu(), b.detach().float().cpu(), 2.0)
    return {"relative_loss_first": losses[0], "relative_loss_last": losses[-1]}, factors


def fit_section() -> list[dict]:
    """Fit error of LoRDBA without and with the input scale q, on the same LoRA factors."""
    a, b, scaling = lora_factors()
    cases = {"gaussian": ({}, (a.float().cpu(), b.float().cpu(), scaling))}
    for name, sigma, normalized in (
        ("adamw_equal_channels", 0.0, False),
        ("adamw_lognormal_channels", 1.0, False),
        ("adamw_lognormal_normalized_target", 1.0, True),
    ):
        cases[name] = trained_lora(sigma, normalized, seed=len(cases))
    records = []
    for case, (training, (lora_a, lora_b, case_scaling)) in cases.items():
        for input_scale in (False, True):
            fit = fit_lora(lora_a, lora_b, case_scaling, input_scale=input_scale)
            footprint = lordba_footprint(HIDDEN, HIDDEN, RANK, input_scale=input_scale)
            records.append(
                {
                    "case": case,
                    "K": HIDDEN,
                    "N": HIDDEN,
                    "rank": RANK,
                    "input_scale": input_scale,
                    **training,
                    "rho_a": fit.residual_ratio_a,
                    "rho_b": fit.residual_ratio_b,
                    "reconstruction_error": fit.reconstruction_error,
                    "predicted_error": fit.predicted_error,
                    "error_bound": fit.error_bound,
                    "lordba_bytes": footprint.lordba_bytes,
                    "bytes_ratio": footprint.ratio,
                }
            )
    return records


def prefill_variants(x: torch.Tensor) -> dict:
    base = make_base()
    weight = base.weight
    a, b, scaling = lora_factors()
    b_scaled = b * scaling
    lordba = make_lordba(base).requires_grad_(False)  # the default: no input scale q
    lordba_q = make_lordba(base, input_scale=True).requires_grad_(False)
    lordba_opaque = make_lordba(OpaqueBase(base)).requires_grad_(False)
    packed = lordba.packed_signs()

    def adapter_only():
        t = sign_down(x, packed.a, lordba.scale_in)
        return sign_up(
            t,
            packed.b,
            HIDDEN,
            row_scale=lordba.scale_rank,
            col_scale=lordba.scale_out,
            out_dtype=x.dtype,
        )

    def adapter_only_fused():
        return sign_adapter(
            x,
            packed.a,
            packed.b,
            HIDDEN,
            rank_scale=lordba.scale_rank,
            col_scale=lordba.scale_out,
            out_dtype=x.dtype,
        )

    # Each LoRDBA variant with the two sign-GEMM kernels and with the fused one (same adapter).
    modules = {"lordba": lordba, "lordba_q": lordba_q, "lordba_opaque_base": lordba_opaque}
    modules |= {f"{name}_fused": twin(module, fused=True) for name, module in modules.items()}
    modules = {name: (module, x) for name, module in modules.items()}
    # The GEMM-epilogue kernel (bf16, also on a CPU): the base alone in its base-only mode and
    # base + adapter with the up-projection in its epilogue, over the plain base and over an
    # Fp8WeightOnlyLinear of it (whose own forward dequantizes the weight at every call).
    x_e = x.to(EPILOGUE_DTYPE)
    base_e = in_dtype(base, EPILOGUE_DTYPE)
    base_fp8 = Fp8WeightOnlyLinear.from_linear(base_e)
    modules |= {
        "lordba_epilogue": (twin(lordba, base_e, gemm_epilogue=True), x_e),
        "lordba_fp8_fused": (twin(lordba, base_fp8, fused=True), x_e),
        "lordba_fp8_epilogue": (twin(lordba, base_fp8, gemm_epilogue=True), x_e),
    }
    variants = {
        "base": lambda: F.linear(x, weight),
        "lora_peft": lambda: F.linear(x, weight) + F.linear(F.linear(x, a), b) * scaling,
        "lora_addmm": lambda: torch.addmm(F.linear(F.linear(x, a), b_scaled), x, weight.t()),
        **{name: (lambda pair=pair: pair[0](pair[1])) for name, pair in modules.items()},
        "lordba_adapter_only": adapter_only,
        "lordba_adapter_only_fused": adapter_only_fused,
        "base_epilogue": lambda: epilogue_base_forward(base_e, x_e),
        "base_fp8": lambda: base_fp8(x_e),
        "base_fp8_epilogue": lambda: epilogue_base_forward(base_fp8, x_e),
    }
    return variants, modules


# The base each variant stands on, for the `*_vs_own_base` ratios: the epilogue variants
# against the same kernel's base-only mode, the FP8 base's fused variant against its forward.
OWN_BASE = {
    "base_epilogue": "base",
    "lordba_epilogue": "base_epilogue",
    "base_fp8_epilogue": "base_fp8",
    "lordba_fp8_fused": "base_fp8",
    "lordba_fp8_epilogue": "base_fp8_epilogue",
}


def own_base_ratios(records: list[dict], group: tuple[str, ...], own_base: dict) -> None:
    """``{eager,graph,host}_vs_own_base`` and ``own_base`` on the records named in
    ``own_base``, against the record of the same ``group`` keys and the named variant."""
    keys = ("eager_ms", "graph_ms", "host_ms")
    index = {(*(r.get(g) for g in group), r.get("variant")): r for r in records}
    for r in records:
        base_name = own_base.get(r.get("variant"))
        ref = index.get((*(r.get(g) for g in group), base_name))
        if base_name is None or ref is None:
            continue
        r["own_base"] = base_name
        for key in keys:
            if r.get(key) is not None and ref.get(key):
                r[key.replace("_ms", "_vs_own_base")] = r[key] / ref[key]


def reference_error(module: LoRDBALinear, x: torch.Tensor) -> float:
    """The timed (Triton) module against the same module on the pure-torch path."""
    reference = copy.deepcopy(module)
    reference.config = dataclasses.replace(module.config, backend="torch")
    with torch.no_grad():
        return relative_error(module(x), reference(x))


def prefill_section() -> list[dict]:
    records = []
    for rows in TOKENS:
        if over_budget(0.5):
            records.append({"M": rows, "skipped": f"over budget at {elapsed():.0f} s"})
            continue
        x = torch.randn(rows, HIDDEN, device=DEVICE, dtype=DTYPE)
        variants, modules = prefill_variants(x)
        for name, fn in variants.items():
            try:
                with torch.no_grad():
                    timing = time_ms(fn)
                record = {
                    "M": rows,
                    "K": HIDDEN,
                    "N": HIDDEN,
                    "rank": RANK,
                    "variant": name,
                    **timing,
                }
                if name in modules:
                    module, inputs = modules[name]
                    record["rel_error_vs_torch_path"] = reference_error(module, inputs)
                    with torch.no_grad():
                        record["path"] = module.forward_path(inputs)
                records.append(record)
            except Exception as error:
                traceback.print_exc()
                records.append(
                    {"M": rows, "variant": name, "error": f"{type(error).__name__}: {error}"}
                )
        print(f"  prefill M={rows} done at {elapsed():.0f} s")
    keys = ("eager_ms", "graph_ms", "host_ms")
    base = {(r["M"], key): r[key] for r in records if r.get("variant") == "base" for key in keys}
    for r in records:
        for key in keys:
            ref = base.get((r.get("M"), key))
            if r.get(key) is not None and ref:
                r[key.replace("_ms", "_vs_base")] = r[key] / ref
        if r.get("variant") == "base" and HIDDEN == 4096 and r["M"] in ANCHOR_BF16_MS:
            r["anchor_bf16_ms"] = ANCHOR_BF16_MS[r["M"]]
            r["eager_vs_anchor"] = r["eager_ms"] / r["anchor_bf16_ms"]
    own_base_ratios(records, ("M",), OWN_BASE)
    return records


def make_model(kind: str) -> tuple[nn.Module, dict[str, LoRDBALinear]]:
    """A Llama-shaped decoder (random weights, no LM head) on the device, frozen, its linears
    quantized as ``kind`` says and then every one adapted by a trained-like LoRDBA adapter
    (rank RANK, no q). Returns the model and its adapters by name."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=MODEL.vocab,
        hidden_size=MODEL.hidden,
        intermediate_size=MODEL.ffn,
        num_hidden_layers=MODEL.layers,
        num_attention_heads=MODEL.heads,
        num_key_value_heads=MODEL.heads,
        max_position_embeddings=max(MODEL.tokens),
    )
    with torch.random.fork_rng(devices=[]), torch.device(DEVICE):
        torch.manual_seed(0)
        model = transformers.LlamaModel(config)
    model = model.to(DTYPE).eval().requires_grad_(False)
    if kind == "loka_fp8":
        model = quantize_fp8_weights(model)
    elif kind in ("int8", "fp8"):
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig() if kind == "int8" else Float8WeightOnlyConfig())
    model = convert_to_lordba(model, LoRDBAConfig(rank=RANK, backend="triton", fused=False))
    adapters = {n: m for n, m in model.named_modules() if isinstance(m, LoRDBALinear)}
    for seed, module in enumerate(adapters.values()):
        trained_like(module, seed=seed).requires_grad_(False)
    return model, adapters


def set_model_variant(model: nn.Module, adapters: dict[str, LoRDBALinear], variant: str) -> None:
    """``base``: the bare bases back in place; ``base_epilogue``: the bases through the
    GEMM-epilogue kernel's base-only mode; ``lordba_unfused`` / ``lordba_fused`` /
    ``lordba_epilogue``: the adapters, with ``LoRDBAConfig.fused`` off / on / and
    ``gemm_epilogue`` on; ``lordba_dense``: the adapters on ``dense_inference`` (two cuBLAS
    GEMMs on dense factors)."""
    if variant in ("base", "base_epilogue"):
        wrap = EpilogueBase if variant == "base_epilogue" else (lambda base: base)
        replace_modules(model, {name: wrap(module.base) for name, module in adapters.items()})
        return
    for module in adapters.values():
        module.config = dataclasses.replace(
            module.config,
            fused=variant in ("lordba_fused", "lordba_epilogue"),
            gemm_epilogue=variant == "lordba_epilogue",
            dense_inference=variant == "lordba_dense",
        )
    replace_modules(model, adapters)


def model_paths(adapters: dict[str, LoRDBALinear]) -> dict[str, int]:
    """How many adapters take each forward path (LoRDBALinear.forward_path) at inference."""
    counts: dict[str, int] = {}
    with torch.no_grad():
        for module in adapters.values():
            x = torch.zeros(1, module.in_features, device=DEVICE, dtype=DTYPE)
            path = module.forward_path(x)
            counts[path] = counts.get(path, 0) + 1
    return counts


def model_section() -> list[dict]:
    """Prefill of the whole decoder per base kind: base alone, + LoRDBA unfused, + fused."""
    records = []
    for kind in MODEL.bases:
        if over_budget(0.8):
            records.append({"base_kind": kind, "skipped": f"over budget at {elapsed():.0f} s"})
            continue
        try:
            model, adapters = make_model(kind)
        except Exception as error:
            traceback.print_exc()
            records.append({"base_kind": kind, "error": f"{type(error).__name__}: {error}"})
            continue
        for rows in MODEL.tokens:
            if over_budget(0.8):
                records.append(
                    {"base_kind": kind, "M": rows, "skipped": f"over budget at {elapsed():.0f} s"}
                )
                continue
            gen = torch.Generator(device="cpu").manual_seed(rows)
            ids = torch.randint(0, MODEL.vocab, (1, rows), generator=gen).to(DEVICE)

            def forward(ids=ids, model=model):
                return model(input_ids=ids, use_cache=False).last_hidden_state

            outputs, by_variant = {}, {}
            variants = ["base", "lordba_unfused", "lordba_fused", "lordba_dense"]
            if kind in EPILOGUE_BASES:
                variants += ["base_epilogue", "lordba_epilogue"]
            for variant in variants:
                record = {
                    "base_kind": kind,
                    "M": rows,
                    "variant": variant,
                    "hidden": MODEL.hidden,
                    "ffn": MODEL.ffn,
                    "layers": MODEL.layers,
                    "rank": RANK,
                    "adapters": len(adapters) if variant.startswith("lordba") else 0,
                }
                try:
                    set_model_variant(model, adapters, variant)
                    if variant.startswith("lordba"):
                        record["paths"] = model_paths(adapters)
                    with torch.no_grad():
                        outputs[variant] = forward()
                        record.update(time_ms(forward))
                except Exception as error:
                    traceback.print_exc()
                    record["error"] = f"{type(error).__name__}: {error}"
                records.append(record)
                by_variant[variant] = record
            for variant in ("lordba_fused", "lordba_epilogue", "lordba_dense"):
                if variant in outputs and "lordba_unfused" in outputs:
                    by_variant[variant]["rel_error_vs_unfused"] = relative_error(
                        outputs[variant], outputs["lordba_unfused"]
                    )
                    if "base" in outputs:  # the adapters change the output: the update is there
                        by_variant[variant]["rel_change_vs_base"] = relative_error(
                            outputs["lordba_unfused"], outputs["base"]
                        )
            print(f"  model {kind} M={rows} done at {elapsed():.0f} s")
        set_model_variant(model, adapters, "base")
        del model, adapters
        if CUDA:
            torch.cuda.empty_cache()
    keys = ("eager_ms", "graph_ms", "host_ms")
    base = {
        (r["base_kind"], r["M"], key): r.get(key)
        for r in records
        if r.get("variant") == "base"
        for key in keys
    }
    for r in records:
        for key in keys:
            ref = base.get((r.get("base_kind"), r.get("M"), key))
            if r.get(key) is not None and ref:
                r[key.replace("_ms", "_vs_base")] = r[key] / ref
    own_base = {"base_epilogue": "base", "lordba_epilogue": "base_epilogue"}
    own_base_ratios(records, ("base_kind", "M"), own_base)
    return records


def train_step_fn(kind: str, rows: int):
    base = make_base()
    x = torch.randn(rows, HIDDEN, device=DEVICE, dtype=DTYPE, requires_grad=True)
    grad = torch.randn(rows, HIDDEN, device=DEVICE, dtype=DTYPE)
    if kind == "lora":
        gen = torch.Generator(device="cpu").manual_seed(3)
        a = nn.Parameter((torch.randn(RANK, HIDDEN, generator=gen) / math.sqrt(HIDDEN)).to(DEVICE))
        b = nn.Parameter(torch.zeros(HIDDEN, RANK, device=DEVICE))
        params = [a, b]

        def forward(x):
            return F.linear(x, base.weight) + F.linear(F.linear(x, a.to(DTYPE)), b.to(DTYPE)) * 2.0
    else:
        module = make_lordba(base)
        params = [p for p in module.parameters() if p.requires_grad]
        forward = module
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def clear():
        optimizer.zero_grad(set_to_none=True)
        x.grad = None

    def step():
        clear()
        forward(x).backward(grad)
        optimizer.step()

    def forward_backward():  # gradients accumulate: the same work each call, capturable
        forward(x).backward(grad)

    state_bytes = sum(p.numel() * p.element_size() * 4 for p in params)  # param, grad, 2 Adam
    return step, clear, forward_backward, state_bytes


def train_section() -> list[dict]:
    records = []
    for rows in TRAIN_TOKENS:
        for kind in ("lora", "lordba"):
            if over_budget(0.9):
                records.append(
                    {"M": rows, "adapter": kind, "skipped": f"over budget at {elapsed():.0f} s"}
                )
                continue
            step, clear, forward_backward, state_bytes = train_step_fn(kind, rows)
            for _ in range(3):  # autotuning, optimizer state allocation
                step()
            record = {
                "M": rows,
                "K": HIDDEN,
                "N": HIDDEN,
                "rank": RANK,
                "adapter": kind,
                "input_scale": LoRDBAConfig.input_scale if kind == "lordba" else None,
                "adapter_state_bytes": state_bytes,
            }
            if CUDA:
                clear()
                torch.cuda.synchronize()
                resident = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                record["resident_bytes"] = resident
                record["peak_bytes"] = torch.cuda.max_memory_allocated()
                record["step_peak_above_resident_bytes"] = record["peak_bytes"] - resident
                times = []
                for _ in range(10):
                    start, end = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    start.record()
                    step()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                record["step_ms"] = sorted(times)[len(times) // 2]
                timing = time_ms(forward_backward)
                record.update({f"fwd_bwd_{key}": value for key, value in timing.items()})
            else:
                t0 = time.perf_counter()
                step()
                record["step_ms"] = (time.perf_counter() - t0) * 1e3
            records.append(record)
            print(f"  train M={rows} {kind}: {record.get('step_ms', 0):.3f} ms")
    by_key = {(r["M"], r["adapter"]): r for r in records if "skipped" not in r}
    for rows in TRAIN_TOKENS:
        lora, lordba = by_key.get((rows, "lora")), by_key.get((rows, "lordba"))
        if lora and lordba:
            for key in (
                "step_peak_above_resident_bytes",
                "peak_bytes",
                "adapter_state_bytes",
                "step_ms",
                "fwd_bwd_eager_ms",
                "fwd_bwd_graph_ms",
                "fwd_bwd_host_ms",
            ):
                if lora.get(key):
                    lordba[f"{key}_vs_lora"] = lordba[key] / lora[key]
    return records


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------


def run_metadata() -> dict:
    return metadata(DEVICE, mode=MODE, autotune=not ARGS.no_autotune, hidden=HIDDEN, rank=RANK,
                    dtype=str(DTYPE), budget_s=BUDGET_S)  # fmt: skip


def summarize(results: dict) -> dict:
    summary = {}
    prefill = [r for r in results.get("prefill", []) if "variant" in r and "error" not in r]
    if prefill:
        key = "graph_vs_base" if CUDA else "eager_vs_base"
        worst = max(
            (r[key] for r in prefill if r["variant"] == "lordba" and key in r), default=None
        )
        summary["prefill_worst_lordba_vs_base"] = worst
        summary["prefill_aim_met"] = worst is not None and worst <= PREFILL_AIM
        errors = [r["rel_error_vs_torch_path"] for r in prefill if "rel_error_vs_torch_path" in r]
        summary["prefill_max_rel_error_vs_torch_path"] = max(errors, default=None)
        own = key.replace("_base", "_own_base")
        for variant in ("lordba_epilogue", "lordba_fp8_epilogue"):
            ratios = [r[own] for r in prefill if r["variant"] == variant and own in r]
            summary[f"prefill_worst_{variant}_vs_own_base"] = max(ratios, default=None)
    model = [r for r in results.get("model", []) if "variant" in r and "error" not in r]
    if model:
        key = "graph_vs_base" if CUDA else "eager_vs_base"
        summary["model_overhead"] = {
            f"{r['base_kind']} M={r['M']} {r['variant']}": r.get(key)
            for r in model
            if r["variant"] != "base"
        }
        # Over the quantized bases: the fused variant against the base model, the epilogue
        # variant against the same kernel's base-only mode (over loka_fp8).
        own = key.replace("_base", "_own_base")
        for variant, ratio, label in [
            ("lordba_fused", key, "fused_vs_quantized_base"),
            ("lordba_dense", key, "dense_vs_quantized_base"),
            ("lordba_epilogue", own, "epilogue_vs_own_quantized_base"),
        ]:
            name = variant.removeprefix("lordba_")
            ratios = [
                r[ratio]
                for r in model
                if r["variant"] == variant and r["base_kind"] != "plain" and ratio in r
            ]
            summary[f"model_worst_{label}"] = max(ratios, default=None)
            summary[f"model_prefill_aim_met_{name}"] = bool(ratios) and max(ratios) <= PREFILL_AIM
            errors = [
                r["rel_error_vs_unfused"]
                for r in model
                if "rel_error_vs_unfused" in r and r["variant"] == variant
            ]
            summary[f"model_max_rel_error_{name}_vs_unfused"] = max(errors, default=None)
    if results.get("bytes"):
        summary["bytes_ratio"] = {
            f"input_scale={r['input_scale']}": r["ratio"] for r in results["bytes"]
        }
    if results.get("fit"):
        summary["fit_error"] = {
            f"{r['case']} input_scale={r['input_scale']}": r["reconstruction_error"]
            for r in results["fit"]
        }
    if results.get("check"):
        summary["check_ok"] = all(r["ok"] for r in results["check"])
    return summary


def print_tables(results: dict) -> None:
    print("\n== LoRDBA summary ==")
    for r in results.get("check", []):
        print(
            f"check  M={r['M']:<5} K={r['K']:<5} N={r['N']:<5} r={r['rank']:<3} "
            f"q={r['input_scale']!s:<5} "
            f"max rel err {r['max_rel_error']:.2e}  {'ok' if r['ok'] else 'FAIL'}"
        )
    for r in results.get("bytes", []):
        print(
            f"bytes  input_scale={r['input_scale']!s:<5}  LoRDBA {r['lordba_bytes']:>8} B  "
            f"fp16 LoRA {r['lora_fp16_bytes']:>8} B  ratio {r['ratio']:.2f}x "
            f"(files {r['file_ratio']:.2f}x; aim >= {BYTES_AIM:.0f}x)"
        )
    fits = results.get("fit", [])
    if fits:
        print(f"\nfit error of the LoRA update (relative Frobenius), hidden {HIDDEN}, rank {RANK}")
        print(f"{'LoRA factors':<34} {'train loss':>13}  {'no q':>6}  {'with q':>6}  rho_A no q/q")
        for case in dict.fromkeys(r["case"] for r in fits):
            pair = {r["input_scale"]: r for r in fits if r["case"] == case}
            loss = ""
            if "relative_loss_first" in pair[False]:
                loss = f"{pair[False]['relative_loss_first']:.3f}->{pair[False]['relative_loss_last']:.3f}"
            print(
                f"{case:<34} {loss:>13}  {pair[False]['reconstruction_error']:6.3f}  "
                f"{pair[True]['reconstruction_error']:6.3f}  "
                f"{pair[False]['rho_a']:.3f}/{pair[True]['rho_a']:.3f}"
            )
    prefill = [r for r in results.get("prefill", []) if "variant" in r]
    if prefill:
        variants = list(dict.fromkeys(r["variant"] for r in prefill))
        for key in ("graph_ms", "eager_ms", "host_ms") if CUDA else ("eager_ms",):
            print(
                f"\nprefill {key} (ratio to base), hidden {HIDDEN}, rank {RANK}; "
                f"aim LoRDBA <= {PREFILL_AIM}x (GPU time: graph_ms)"
            )
            print("tokens  " + "  ".join(f"{v:>24}" for v in variants))
            for rows in TOKENS:
                cells = []
                for v in variants:
                    r = next((r for r in prefill if r["M"] == rows and r["variant"] == v), None)
                    if r is None or r.get(key) is None:
                        cells.append(f"{'-':>24}")
                    else:
                        ratio = r.get(key.replace("_ms", "_vs_base"), float("nan"))
                        cells.append(f"{r[key]:>12.4f} ({ratio:>5.3f}x)".rjust(24))
                print(f"{rows:>6}  " + "  ".join(cells))
    model = [r for r in results.get("model", []) if "variant" in r]
    if model:
        print(
            f"\nmodel prefill (Llama-shaped, hidden {MODEL.hidden}, FFN {MODEL.ffn}, "
            f"{MODEL.layers} layers, LoRDBA rank {RANK} on every linear); ratio to the base "
            f"model; aim <= {PREFILL_AIM}x"
        )
        keys = ("graph_ms", "eager_ms", "host_ms") if CUDA else ("eager_ms",)
        print(f"{'base':<9} {'tokens':>6}  {'variant':<15} " + "  ".join(f"{k:>20}" for k in keys))
        for r in model:
            cells = []
            for key in keys:
                if r.get(key) is None:
                    cells.append(f"{'-':>20}")
                else:
                    ratio = r.get(key.replace("_ms", "_vs_base"), float("nan"))
                    cells.append(f"{r[key]:>10.4f} ({ratio:>5.3f}x)".rjust(20))
            extra = f"  error: {r['error']}" if "error" in r else ""
            own = "graph_vs_own_base" if CUDA else "eager_vs_own_base"
            if own in r:
                extra += f"  {r[own]:.3f}x of {r['own_base']}"
            if "rel_error_vs_unfused" in r:
                extra += f"  vs unfused rel err {r['rel_error_vs_unfused']:.1e}"
            if r.get("paths"):
                extra += f"  paths {r['paths']}"
            print(
                f"{r['base_kind']:<9} {r['M']:>6}  {r['variant']:<15} " + "  ".join(cells) + extra
            )
    for r in prefill:
        if "anchor_bf16_ms" in r:
            print(
                f"anchor: base at M={r['M']} {r['eager_ms']:.4f} ms eager, H200 anchor "
                f"{r['anchor_bf16_ms']:.4f} ms ({r['eager_vs_anchor']:.2f}x)"
            )
    for r in results.get("train", []):
        if "skipped" in r:
            continue
        extra = ""
        if "step_peak_above_resident_bytes_vs_lora" in r:
            extra = (
                f"  vs LoRA: peak-above-resident {r['step_peak_above_resident_bytes_vs_lora']:.2f}x, "
                f"peak {r['peak_bytes_vs_lora']:.2f}x, step {r['step_ms_vs_lora']:.2f}x"
            )
        peak = r.get("step_peak_above_resident_bytes")
        peak_text = f"peak above resident {peak / 2**20:8.1f} MiB" if peak is not None else ""
        print(f"train  M={r['M']:<5} {r['adapter']:<7} {r['step_ms']:8.3f} ms  {peak_text}{extra}")
        if r.get("fwd_bwd_eager_ms") is not None:
            graph = r.get("fwd_bwd_graph_ms")
            print(
                f"       fwd+bwd eager {r['fwd_bwd_eager_ms']:.3f} ms, graph "
                f"{'-' if graph is None else f'{graph:.3f}'} ms, host {r['fwd_bwd_host_ms']:.3f} ms"
            )
    print("\nsummary:", json.dumps(summarize(results)))


def main(argv: list[str] | None = None) -> int:
    configure(parse_args(argv))
    if not CUDA and MODE == "cpu" and not set(SECTIONS) <= CPU_SECTIONS:
        raise SystemExit(
            "bench/lordba.py needs a CUDA GPU for sections other than "
            f"{sorted(CPU_SECTIONS)}; use --smoke on CPU"
        )
    if ARGS.no_autotune:
        os.environ["LOKA_KERNELS_AUTOTUNE"] = "0"
    out = Path(ARGS.out)
    sections = SECTIONS
    results: dict = {}
    failures = []
    print(f"LoRDBA bench ({MODE}) on {DEVICE}: hidden {HIDDEN}, rank {RANK}, {DTYPE}")
    with tempfile.TemporaryDirectory() as tmp:
        runners = {
            "check": check_section,
            "bytes": lambda: bytes_section(Path(tmp)),
            "fit": fit_section,
            "prefill": prefill_section,
            "model": model_section,
            "train": train_section,
        }
        for section in sections:
            print(f"[{elapsed():6.1f} s] {section}")
            try:
                results[section] = runners[section]()
            except Exception as error:
                traceback.print_exc()
                failures.append(section)
                results[section + "_error"] = f"{type(error).__name__}: {error}"
    stamp = utc_stamp()
    record = {
        "metadata": run_metadata(),
        "summary": summarize(results),
        "results": results,
        "wall_s": elapsed(),
    }
    write_json(out / f"lordba_{MODE}_{stamp}.json", record)
    for section in ("prefill", "model"):
        rows = [r for r in results.get(section, []) if "variant" in r]
        if rows:
            fields = sorted({k for r in rows for k in r})
            write_csv(out / f"lordba_{section}_{MODE}_{stamp}.csv", rows, fields)
    print_tables(results)
    print(f"\nwrote {out}/lordba_{MODE}_{stamp}.* in {elapsed():.0f} s")
    checks_ok = all(r["ok"] for r in results.get("check", []))
    return 1 if failures or not checks_ok else 0


if __name__ == "__main__":
    sys.exit(main())
