"""``LoRDBALinear``: a frozen base linear plus a binary-sign low-rank adapter.

    out = base(x) + s * p * (sign(B) @ (m * (sign(A) @ (q * x))))

``A: [r, K]`` and ``B: [N, r]`` are latent full-precision factors that only enter through
their signs; ``q: [K]`` (optional, off by default: ``LoRDBAConfig.input_scale``), ``m: [r]``
and ``p: [N]`` are channel scales; ``s`` is a fixed multiplier. The effective update
``diag(p) sign(B) diag(m) sign(A) diag(q)`` equals the LoRA update ``B A`` whenever ``|B|``
has rank one and ``|A|`` has rank one (with ``q``) or is constant along each row (without
``q``); see :mod:`loka.lordba.fit`.

Training: the sign's gradient goes straight through to its latent, gated off where the
latent has saturated (``|latent| > ste_clip * rms at init``); scales get exact gradients.
Use an Adam-type optimizer: the sign gradient's scale is not the latent's.

Inference on the Triton kernels runs the adapter as one fused launch (``sign_adapter``) where
it applies (``LoRDBAConfig.fused``), or, with ``LoRDBAConfig.gemm_epilogue``, the base GEMM
itself as a Triton kernel with the up-projection in its epilogue (``linear_sign_up``);
:meth:`LoRDBALinear.forward_path` names the path an input takes.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from loka.kernels.runtime import capability
from loka.lordba.config import EPILOGUE_MAX_RANK, FUSED_MAX_RANK, LoRDBAConfig
from loka.lordba.fit import LoRDBAFit, fit_lora
from loka.lordba.function import (
    LoRDBAFunction,
    PackedSigns,
    pack_factor_signs,
    select_ops,
)
from loka.lordba.kernels import linear_sign_up
from loka.lordba.quantized import (
    Fp8WeightOnlyLinear,
    GemmOperands,
    gemm_operands,
    plain_weight,
)
from loka.mods.weight_stamp import weight_stamp

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the sign kernels take
# Inputs the GEMM-epilogue path takes: tensor-core dtypes. float32 keeps cuBLAS (the kernel's
# float32 GEMM runs IEEE dots, correct but far from cuBLAS's speed).
_EPILOGUE_DTYPES = (torch.float16, torch.bfloat16)


def base_features(base: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a linear-like module."""
    in_features = getattr(base, "in_features", None)
    out_features = getattr(base, "out_features", None)
    if isinstance(in_features, int) and isinstance(out_features, int):
        return in_features, out_features
    weight = getattr(base, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.shape[1], weight.shape[0]
    raise TypeError(
        f"cannot tell the shape of {type(base).__name__}: give it in_features/out_features "
        "or a 2-D weight [out, in]"
    )


def base_device(base: nn.Module) -> torch.device:
    """The one device holding ``base``'s tensors (its ``weight``, parameters and buffers, e.g. an
    FP8 weight kept as a buffer); the CPU for a base without tensors."""
    tensors = [*base.parameters(), *base.buffers()]
    weight = getattr(base, "weight", None)
    if isinstance(weight, torch.Tensor):
        tensors.append(weight)
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"the base {type(base).__name__} has tensors on several devices "
            f"{sorted(map(str, devices))}; move it to one device first"
        )
    return devices.pop() if devices else torch.device("cpu")


def epilogue_operands(base: nn.Module, x: torch.Tensor) -> GemmOperands | None:
    """:func:`~loka.lordba.quantized.gemm_operands` of ``base`` for ``x`` where LoKA's GEMM
    (``linear_sign_up``) can run it on ``x``'s device: FP8 codes need a GPU with FP8
    conversions (sm_89+) or the CPU interpreter."""
    operands = gemm_operands(base, x.dtype)
    if operands is None or operands.weight.device != x.device:
        return None
    fp8 = operands.weight_scale is not None
    if fp8 and x.device.type == "cuda" and (capability(x.device) or (0, 0)) < (8, 9):
        return None
    return operands


def epilogue_base_forward(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``base(x)`` through the GEMM-epilogue kernel's base-only mode (no adapter): the base
    the ``gemm_epilogue`` path runs, on the same kernel, for benchmarks. A plain ``nn.Linear``
    (weight of x's dtype) or an ``Fp8WeightOnlyLinear``; needs a CUDA tensor or the Triton
    interpreter."""
    operands = epilogue_operands(base, x)
    if operands is None:
        raise TypeError(
            f"epilogue_base_forward: no GEMM-epilogue form of {type(base).__name__} for "
            f"{x.dtype} inputs on {x.device}"
        )
    x2 = x.reshape(-1, x.shape[-1])
    out = linear_sign_up(
        x2,
        operands.weight,
        weight_scale=operands.weight_scale,
        fp8_format=operands.fp8_format,
        bias=operands.bias,
    )
    return out.reshape(*x.shape[:-1], out.shape[-1])


def latent_rms(values: torch.Tensor) -> float:
    """RMS of a latent factor (1.0 for an all-zero or non-finite one)."""
    rms = float(values.detach().float().square().mean().sqrt()) if values.numel() else 0.0
    return rms if rms > 0 and math.isfinite(rms) else 1.0


class LoRDBALinear(nn.Module):
    """A frozen ``base`` (``nn.Linear``, a quantized linear: torchao int8/FP8 weight-only,
    :class:`~loka.lordba.quantized.Fp8WeightOnlyLinear`, ``loka.mods.Fp8Linear``; or any module
    with ``in_features``/``out_features``) plus a trainable LoRDBA adapter. A fresh adapter starts at zero output (``p = 0``), on the
    device of the base's tensors; ``.to()`` moves base and adapter together."""

    def __init__(self, base: nn.Module, config: LoRDBAConfig | None = None) -> None:
        super().__init__()
        config = config or LoRDBAConfig()
        self.config = config
        self.in_features, self.out_features = base_features(base)
        self.base = base.requires_grad_(False)
        rank, k, n = config.rank, self.in_features, self.out_features
        # Drawn on the CPU (the same adapter for a seed on any device, and the latents' RMS is
        # read without a device sync), then placed beside the base's tensors.
        bound_a = 1.0 / math.sqrt(k)
        latent_a = torch.empty(rank, k).uniform_(-bound_a, bound_a)
        latent_b = torch.empty(n, rank).uniform_(-1.0, 1.0) / math.sqrt(n)
        self.latent_rms_a = latent_rms(latent_a)
        self.latent_rms_b = latent_rms(latent_b)
        f32 = {"device": base_device(base), "dtype": torch.float32}
        self.latent_a = nn.Parameter(latent_a.to(**f32))
        self.latent_b = nn.Parameter(latent_b.to(**f32))
        self.scale_in = nn.Parameter(torch.ones(k, **f32)) if config.input_scale else None
        # ||sign(A) x|| ~ sqrt(K) ||x||: m keeps the rank activations at the input's scale.
        self.scale_rank = nn.Parameter(torch.full((rank,), bound_a, **f32))
        self.scale_out = nn.Parameter(torch.zeros(n, **f32))
        self.scaling = float(config.scaling)
        self._packed_cache: tuple[tuple, PackedSigns] | None = None
        self._dense_cache: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    # ---- construction -----------------------------------------------------------------

    @classmethod
    def from_lora(
        cls,
        base: nn.Module,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scaling: float = 1.0,
        config: LoRDBAConfig | None = None,
    ) -> tuple[LoRDBALinear, LoRDBAFit]:
        """Wrap ``base`` with the LoRDBA fit of the LoRA ``scaling * lora_b @ lora_a``.

        The adapter's rank is the LoRA's; ``config.scaling`` is replaced by 1 (the LoRA's
        scaling is folded into ``p``). Returns the module and the fit report.
        """
        in_features, out_features = base_features(base)
        if lora_a.dim() != 2 or lora_b.dim() != 2:
            raise ValueError(
                f"LoRA factors must be 2-D, got A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)}"
            )
        if lora_a.shape[1] != in_features or lora_b.shape[0] != out_features:
            raise ValueError(
                f"LoRA shapes A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} do not fit a base "
                f"with in_features={in_features}, out_features={out_features}"
            )
        config = config or LoRDBAConfig(rank=lora_a.shape[0])
        fit = fit_lora(lora_a, lora_b, scaling, input_scale=config.input_scale)
        module = cls(base, replace(config, rank=lora_a.shape[0], scaling=1.0))
        module.load_fit(fit)
        return module, fit

    @torch.no_grad()
    def load_fit(self, fit: LoRDBAFit) -> None:
        """Set latents and scales from a :class:`LoRDBAFit` (shapes must match)."""
        pairs = [
            (self.latent_a, fit.latent_a, "latent_a"),
            (self.latent_b, fit.latent_b, "latent_b"),
            (self.scale_rank, fit.scale_rank, "scale_rank"),
            (self.scale_out, fit.scale_out, "scale_out"),
        ]
        if (self.scale_in is None) != (fit.scale_in is None):
            raise ValueError(
                f"input_scale mismatch: module {'has' if self.scale_in is not None else 'has no'} "
                f"scale_in, the fit {'has' if fit.scale_in is not None else 'has none'}"
            )
        if self.scale_in is not None:
            pairs.append((self.scale_in, fit.scale_in, "scale_in"))
        for param, value, name in pairs:
            if param.shape != value.shape:
                raise ValueError(
                    f"{name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}"
                )
        for param, value, _ in pairs:
            param.copy_(value)
        self.latent_rms_a = latent_rms(self.latent_a)
        self.latent_rms_b = latent_rms(self.latent_b)

    # ---- forward ------------------------------------------------------------------------

    @property
    def clip_a(self) -> float:
        return self.config.ste_clip * self.latent_rms_a

    @property
    def clip_b(self) -> float:
        return self.config.ste_clip * self.latent_rms_b

    def packed_signs(self) -> PackedSigns:
        """Current signs, packed; reused while the latents are unchanged. Under torch.compile
        they are packed in the graph each call: a traced tensor kept in the cache would leak
        one graph's symbols into the next trace."""
        if torch.compiler.is_compiling():
            return pack_factor_signs(self.latent_a, self.latent_b)
        key = (weight_stamp(self.latent_a), weight_stamp(self.latent_b), self.latent_a.device)
        if self._packed_cache is None or self._packed_cache[0] != key:
            self._packed_cache = (key, pack_factor_signs(self.latent_a, self.latent_b))
        return self._packed_cache[1]

    @torch.no_grad()
    def dense_factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A', B')`` of the dense inference path in ``dtype``: ``A' = sign(A) diag(q)``
        ``[r, K]`` and ``B' = s diag(p) sign(B) diag(m)`` ``[N, r]``, so that the update is
        ``(x @ A'^T) @ B'^T``. Made in float32 and rounded once; kept until a latent, a scale,
        ``s`` or the dtype changes. Under torch.compile they are made in the graph each call
        (a few elementwise ops over ``r (K + N)`` values), without the cache's Python."""
        if torch.compiler.is_compiling():
            right, left = self._float_factors()
            return right.to(dtype), left.to(dtype)
        params = [self.latent_a, self.latent_b, self.scale_rank, self.scale_out]
        if self.scale_in is not None:
            params.append(self.scale_in)
        key = (*(weight_stamp(p) for p in params), self.scaling, dtype, self.latent_a.device)
        if self._dense_cache is None or self._dense_cache[0] != key:
            right, left = self._float_factors()
            self._dense_cache = (key, (right.to(dtype), left.to(dtype)))
        return self._dense_cache[1]

    def _float_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sign(A) diag(q), s diag(p) sign(B) diag(m))`` in float32: the update is their
        product, right factor last."""
        signs_a = torch.where(self.latent_a < 0, -1.0, 1.0)
        signs_b = torch.where(self.latent_b < 0, -1.0, 1.0)
        right = signs_a if self.scale_in is None else signs_a * self.scale_in.float()
        left = self.scaling * self.scale_out.float()[:, None] * signs_b * self.scale_rank.float()
        return right, left

    def forward_path(self, x: torch.Tensor) -> str:
        """The path :meth:`forward` takes for ``x`` in the current grad/autocast state:

        - ``"dense"`` (``config.dense_inference``): inference over any base: the base's own
          forward, then the adapter as two cuBLAS GEMMs on dense factors
          (:meth:`dense_factors`), the second accumulating into the base's output;
        - ``"gemm_epilogue"`` (``config.gemm_epilogue``): inference over a plain ``nn.Linear``
          (weight of x's dtype) or an ``Fp8WeightOnlyLinear`` base, bf16/fp16 inputs:
          ``sign_down``, then one Triton GEMM of the base with the up-projection, scales and
          bias in its epilogue (``linear_sign_up``);
        - ``"addmm_fused"``: inference over a plain ``nn.Linear`` base; the one-launch
          ``sign_adapter`` kernel computes the update (bias added in its epilogue), which the
          base GEMM's ``addmm`` reads as its accumulator;
        - ``"addmm"``: the same with the two sign-GEMM kernels (``sign_down``, ``sign_up``);
        - ``"base_fused"``: inference over any other base (quantized ones): the base's own
          forward, then ``sign_adapter`` adds the update into its output;
        - ``"base"``: the base's own forward, then the autograd function (two kernels, the
          rank activations saved for the backward): training, and every other case.

        The fused kernel has no backward, so it is taken only when no gradient is needed, on
        a Triton backend (``backend="triton"``, or ``"auto"`` on CUDA: the torch references
        have no fused op), with ``config.fused`` and ``rank <= FUSED_MAX_RANK``.
        """
        x2 = x.reshape(-1, self.in_features)
        if self._dense_ok(x2):
            return "dense"
        ops = select_ops(self.config.backend, x.device)
        if self._epilogue_ok(x2, ops) is not None:
            return "gemm_epilogue"
        fused = self._fused_ok(x2, ops)
        if self._addmm_ok(x2):
            return "addmm_fused" if fused else "addmm"
        return "base_fused" if fused else "base"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"LoRDBALinear expects inputs [..., {self.in_features}], got {tuple(x.shape)}"
            )
        if not x.is_floating_point():
            raise TypeError(f"LoRDBALinear expects a floating-point input, got {x.dtype}")
        if x.device != self.latent_a.device:
            raise ValueError(
                f"LoRDBALinear: the input is on {x.device}, the adapter on "
                f"{self.latent_a.device}; move the module with .to({str(x.device)!r})"
            )
        x2 = x.reshape(-1, self.in_features)
        if self._dense_ok(x2):
            return self._dense_inference(x, x2)
        ops = select_ops(self.config.backend, x.device)
        packed = self.packed_signs()
        operands = self._epilogue_ok(x2, ops)
        if operands is not None:
            return self._epilogue_inference(x2, packed, ops, operands).reshape(
                *x.shape[:-1], self.out_features
            )
        fused = self._fused_ok(x2, ops)
        if self._addmm_ok(x2):
            return self._linear_inference(x2, packed, ops, fused).reshape(
                *x.shape[:-1], self.out_features
            )
        y = self.base(x)
        y2 = y.reshape(-1, self.out_features)
        # Under autocast the base runs in a lower precision than x: the adapter follows it.
        x2 = x2.to(y2.dtype)
        if fused:
            return self._fused_update(x2, packed, ops, addend=y2).reshape(y.shape)
        out = LoRDBAFunction.apply(
            x2,
            y2,
            self.latent_a,
            self.latent_b,
            self.scale_in,
            self.scale_rank,
            self.scale_out,
            self.scaling,
            self.clip_a,
            self.clip_b,
            packed.a,
            packed.b,
            ops,
        )
        return out.reshape(y.shape)

    def _inference(self, x2: torch.Tensor) -> bool:
        """No gradient will be asked of this forward (of x, the adapter or the base)."""
        if not torch.is_grad_enabled():
            return True
        return not (x2.requires_grad or any(p.requires_grad for p in self.parameters()))

    def _dense_ok(self, x2: torch.Tensor) -> bool:
        """The dense inference path applies (see :meth:`forward_path`)."""
        return self.config.dense_inference and self._inference(x2)

    def _dense_inference(self, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """``base(x) + (x @ A'^T) @ B'^T``: two cuBLAS GEMMs, the second accumulating into
        the base's output in place where that output is known to be fresh: an out-of-place
        ``addmm`` first copies its accumulator into the result, two more passes over
        ``[M, N]``. Under torch.compile the sum is written functionally (inductor reuses the
        buffer itself; a traced tensor has no storage to judge)."""
        y = self.base(x)
        y2 = y.reshape(-1, self.out_features)
        # Under autocast the base runs in a lower precision than x: the adapter follows it.
        a, b = self.dense_factors(y2.dtype)
        rank_act = x2.to(y2.dtype) @ a.t()
        if not torch.compiler.is_compiling() and self._fresh_output(y, x):
            return y2.addmm_(rank_act, b.t()).reshape(y.shape)
        return torch.addmm(y2, rank_act, b.t()).reshape(y.shape)

    def _fresh_output(self, y: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether ``y = base(x)`` may be written in place: a linear LoKA knows (``nn.Linear``
        whatever its weight, ``Fp8Linear``, ``Fp8WeightOnlyLinear``) returned the whole of an
        allocation of its own, not sharing ``x``'s memory. A view is fine when it spans all
        of its storage: torchao's int8 weight-only linear returns its GEMM's output reshaped
        (out of place there, the adapter cost 1.09 ms where it cost 0.80 over the FP8 base,
        `lordba_full_20261203T221402Z`). Other bases might return a buffer they keep, and a
        tensor subclass (a DTensor, say) has no storage of its own to judge by."""
        plain = type(y) is torch.Tensor and type(x) is torch.Tensor
        if not (plain and isinstance(self.base, (nn.Linear, Fp8WeightOnlyLinear))):
            return False
        storage = y.untyped_storage()
        return (
            y.is_contiguous()
            and y.storage_offset() == 0
            and storage.nbytes() == y.numel() * y.element_size()
            and storage.data_ptr() != x.untyped_storage().data_ptr()
        )

    def _fused_ok(self, x2: torch.Tensor, ops) -> bool:
        """The one-launch ``sign_adapter`` kernel applies (see :meth:`forward_path`)."""
        return (
            self.config.fused
            and ops.fused is not None
            and self.config.rank <= FUSED_MAX_RANK
            and x2.dtype in _KERNEL_DTYPES
            and self._inference(x2)
        )

    def _epilogue_ok(self, x2: torch.Tensor, ops) -> GemmOperands | None:
        """The base's GEMM operands when the GEMM-epilogue path applies (see
        :meth:`forward_path`), else None."""
        if not (
            self.config.gemm_epilogue
            and ops.epilogue is not None
            and self.config.rank <= EPILOGUE_MAX_RANK
            and x2.dtype in _EPILOGUE_DTYPES
            and not torch.is_autocast_enabled(x2.device.type)
            and self._inference(x2)
        ):
            return None
        return epilogue_operands(self.base, x2)

    def _epilogue_inference(
        self, x2: torch.Tensor, packed: PackedSigns, ops, operands: GemmOperands
    ) -> torch.Tensor:
        """``t = sign_down(x q)``, then the base GEMM whose epilogue adds
        ``s * p * ((t * m) @ sign(B)^T)`` and the bias: the update never reaches memory."""
        t = ops.down(x2, packed.a, self.scale_in)
        return ops.epilogue(
            x2,
            operands.weight,
            weight_scale=operands.weight_scale,
            fp8_format=operands.fp8_format,
            bias=operands.bias,
            rank_act=t,
            packed=packed.b,
            rank_scale=self.scale_rank,
            col_scale=self.scale_out,
            alpha=self.scaling,
            out_dtype=x2.dtype,
        )

    def _addmm_ok(self, x2: torch.Tensor) -> bool:
        """Inference on a plain ``nn.Linear`` base with an ordinary weight of x's dtype, outside
        autocast. A quantized weight (a tensor subclass such as torchao's, which implements
        ``F.linear`` but not ``t``/``addmm``) runs through the base's own forward."""
        if type(self.base) is not nn.Linear:
            return False
        weight = plain_weight(self.base)
        if weight is None or x2.dtype != weight.dtype:
            return False
        if torch.is_autocast_enabled(x2.device.type):
            return False
        return self._inference(x2)

    def _fused_update(
        self,
        x2: torch.Tensor,
        packed: PackedSigns,
        ops,
        addend: torch.Tensor | None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``addend + s * p * (sign(B) @ (m * (sign(A) @ (q * x))))`` in one kernel launch."""
        return ops.fused(
            x2,
            packed.a,
            packed.b,
            self.out_features,
            in_scale=self.scale_in,
            rank_scale=self.scale_rank,
            col_scale=self.scale_out,
            alpha=self.scaling,
            addend=addend,
            out_dtype=out_dtype,
        )

    def _linear_inference(
        self, x2: torch.Tensor, packed: PackedSigns, ops, fused: bool
    ) -> torch.Tensor:
        """The adapter output becomes the GEMM's accumulator input: one ``addmm`` reads it in
        its epilogue instead of a separate pass over ``y``; the bias rides in the adapter."""
        base: nn.Linear = self.base
        bias = None if base.bias is None else base.bias.expand(x2.shape[0], -1)
        # The update is this call's own tensor: accumulate into it in place (an out-of-place
        # addmm would first copy it into the result).
        if fused:
            update = self._fused_update(x2, packed, ops, addend=bias, out_dtype=x2.dtype)
            return update.addmm_(x2, base.weight.t())
        t = ops.down(x2, packed.a, self.scale_in)
        update = ops.up(
            t,
            packed.b,
            self.out_features,
            row_scale=self.scale_rank,
            col_scale=self.scale_out,
            alpha=self.scaling,
            addend=bias,
            out_dtype=x2.dtype,
        )
        return update.addmm_(x2, base.weight.t())

    # ---- inspection ---------------------------------------------------------------------

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """The dense update ``s * diag(p) sign(B) diag(m) sign(A) diag(q)``, float32 ``[N, K]``."""
        right, left = self._float_factors()
        return left @ right

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rank={self.config.rank}, input_scale={self.config.input_scale}"
        )

    def get_extra_state(self) -> dict:
        return {
            "scaling": self.scaling,
            "latent_rms_a": self.latent_rms_a,
            "latent_rms_b": self.latent_rms_b,
        }

    def set_extra_state(self, state: dict) -> None:
        self.scaling = float(state["scaling"])
        self.latent_rms_a = float(state["latent_rms_a"])
        self.latent_rms_b = float(state["latent_rms_b"])
