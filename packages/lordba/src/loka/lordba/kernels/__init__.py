"""Sign-GEMMs: matmuls against bit-packed +-1 matrices with fused channel scales.

The building blocks of binary-sign adapters (LoRDBA): signs stay packed 8 per byte in memory
and are unpacked in registers; every kernel has a pure-torch ``*_reference`` beside it.
"""

from loka.lordba.kernels.base_epilogue import linear_sign_up, linear_sign_up_reference
from loka.lordba.kernels.down import sign_down, sign_down_reference
from loka.lordba.kernels.fused import sign_adapter, sign_adapter_reference
from loka.lordba.kernels.packing import (
    SIGNS_PER_BYTE,
    check_packed_signs,
    check_padding_bits,
    pack_signs,
    packed_length,
    unpack_signs,
)
from loka.lordba.kernels.up import sign_up, sign_up_reference
from loka.lordba.kernels.wgrad import sign_wgrad, sign_wgrad_reference

__all__ = [
    "SIGNS_PER_BYTE",
    "check_packed_signs",
    "check_padding_bits",
    "linear_sign_up",
    "linear_sign_up_reference",
    "pack_signs",
    "packed_length",
    "sign_adapter",
    "sign_adapter_reference",
    "sign_down",
    "sign_down_reference",
    "sign_up",
    "sign_up_reference",
    "sign_wgrad",
    "sign_wgrad_reference",
    "unpack_signs",
]


def _register() -> None:
    """Backends of ops ``sign_down``, ``sign_up``, ``sign_wgrad`` and ``linear_sign_up``
    (signatures: the functions above): ``triton.<op>`` (the kernels) and ``torch.<op>`` (the references)."""
    from loka.kernels.registry import BF16, Backend, registry

    ops = {
        "sign_down": (sign_down, sign_down_reference, "(x * col_scale) @ S^T, S packed"),
        "sign_up": (sign_up, sign_up_reference, "addend + col * ((left * row) @ S), S packed"),
        "sign_wgrad": (sign_wgrad, sign_wgrad_reference, "straight-through grads of scaled S"),
        "linear_sign_up": (
            linear_sign_up,
            linear_sign_up_reference,
            "x @ W^T (W float or FP8 codes) + bias + col * ((left * row) @ S) in one GEMM",
        ),
    }
    for op, (kernel, reference, what) in ops.items():
        variants = [
            ("triton", kernel, "signs unpacked in registers", {"triton": True, "priority": 1}),
            ("torch", reference, "plain torch (the reference)", {"runs_on_cpu": True}),
        ]
        for library, run, how, flags in variants:
            backend = Backend(
                name=f"{library}.{op}",
                op=op,
                run=run,
                reference=reference,
                description=f"{what}; {how}",
                formats=frozenset({(BF16, BF16)}),
                granularities=frozenset({"none"}),
                min_capability=None,
                **flags,
            )
            registry.register(backend, replace=True)


_register()
