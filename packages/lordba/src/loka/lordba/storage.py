"""Shipping LoRDBA adapters: signs bit-packed (8 per byte), scales in fp16, one safetensors file.

File layout (format ``loka-lordba``, version 1), per adapted module ``<name>``:

* ``<name>.signs_a``: uint8 ``[r, ceil(K/8)]``, sign(A) packed along K;
* ``<name>.signs_b``: uint8 ``[r, ceil(N/8)]``, sign(B)^T packed along N;
* ``<name>.scale_in`` (fp16 ``[K]``, only with an input scale), ``<name>.scale_rank`` (fp16
  ``[r]``), ``<name>.scale_out`` (fp16 ``[N]``);
* header metadata: ``format``, ``format_version`` and a JSON ``modules`` record with each
  module's ``in_features``, ``out_features``, ``rank``, ``scaling`` and the latents' RMS.

Latent magnitudes are not shipped: a loaded adapter's latents are ``sign * rms``, which keeps
every sign (the adapter's forward is exactly the saved one) and gives training a sensible
starting scale. Writes are atomic (temporary file, then rename).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from loka.lordba.config import LoRDBAConfig
from loka.lordba.convert import replace_modules
from loka.lordba.fit import LoRDBAFit
from loka.lordba.function import pack_factor_signs
from loka.lordba.kernels import (
    check_packed_signs,
    check_padding_bits,
    packed_length,
    unpack_signs,
)
from loka.lordba.module import LoRDBALinear, base_features, latent_rms

FORMAT_NAME = "loka-lordba"
FORMAT_VERSION = 1
_SCALE_DTYPE = torch.float16
_TENSORS = ("signs_a", "signs_b", "scale_in", "scale_rank", "scale_out")


@dataclass(frozen=True)
class Footprint:
    """Adapter bytes: LoRDBA (packed signs + fp16 scales) against an fp16 LoRA of one rank."""

    lordba_bytes: int
    lora_fp16_bytes: int

    @property
    def ratio(self) -> float:
        """How many times smaller than the fp16 LoRA."""
        return self.lora_fp16_bytes / self.lordba_bytes


def lordba_footprint(
    in_features: int, out_features: int, rank: int, *, input_scale: bool = False
) -> Footprint:
    """Bytes of one adapter as stored, e.g. ``lordba_footprint(4096, 4096, 16).ratio``."""
    signs = rank * (packed_length(in_features) + packed_length(out_features))
    scales = 2 * (rank + out_features + (in_features if input_scale else 0))
    return Footprint(signs + scales, 2 * rank * (in_features + out_features))


@dataclass(frozen=True)
class PackedLoRDBA:
    """One adapter as stored; see the module docstring for the tensors."""

    in_features: int
    out_features: int
    signs_a: torch.Tensor
    signs_b: torch.Tensor
    scale_in: torch.Tensor | None
    scale_rank: torch.Tensor
    scale_out: torch.Tensor
    scaling: float = 1.0
    latent_rms_a: float = 1.0
    latent_rms_b: float = 1.0

    @property
    def rank(self) -> int:
        return self.scale_rank.shape[0]

    @property
    def nbytes(self) -> int:
        tensors = (self.signs_a, self.signs_b, self.scale_in, self.scale_rank, self.scale_out)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def validate(self, name: str = "adapter") -> None:
        """Raise a clear error for any wrong dtype, shape, stray padding bit or non-finite scale."""
        rank = self.rank
        check_packed_signs(self.signs_a, rank, self.in_features, f"{name}.signs_a")
        check_packed_signs(self.signs_b, rank, self.out_features, f"{name}.signs_b")
        check_padding_bits(self.signs_a, self.in_features, f"{name}.signs_a")
        check_padding_bits(self.signs_b, self.out_features, f"{name}.signs_b")
        scales = [
            ("scale_rank", self.scale_rank, rank),
            ("scale_out", self.scale_out, self.out_features),
        ]
        if self.scale_in is not None:
            scales.append(("scale_in", self.scale_in, self.in_features))
        for label, scale, length in scales:
            if scale.dtype != _SCALE_DTYPE:
                raise TypeError(f"{name}.{label}: scales are stored as float16, got {scale.dtype}")
            if tuple(scale.shape) != (length,):
                raise ValueError(
                    f"{name}.{label}: expected shape ({length},), got {tuple(scale.shape)}"
                )
            if not bool(torch.isfinite(scale).all()):
                raise ValueError(f"{name}.{label}: contains NaN or Inf")

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The stored tensors, keyed ``prefix + name``."""
        return {
            prefix + key: getattr(self, key).contiguous().cpu()
            for key in _TENSORS
            if getattr(self, key) is not None
        }

    def record(self) -> dict:
        return {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "rank": self.rank,
            "input_scale": self.scale_in is not None,
            "scaling": self.scaling,
            "latent_rms_a": self.latent_rms_a,
            "latent_rms_b": self.latent_rms_b,
        }


def _fp16_scale(param: torch.Tensor, name: str) -> torch.Tensor:
    scale = param.detach().to(_SCALE_DTYPE)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{name}: NaN, Inf or values beyond float16 range (max 65504)")
    return scale.cpu()


@torch.no_grad()
def _pack(
    name: str,
    latent_a: torch.Tensor,
    latent_b: torch.Tensor,
    scale_in: torch.Tensor | None,
    scale_rank: torch.Tensor,
    scale_out: torch.Tensor,
    scaling: float,
    rms: tuple[float, float],
) -> PackedLoRDBA:
    for label, latent in (("latent_a", latent_a), ("latent_b", latent_b)):
        if not bool(torch.isfinite(latent).all()):
            raise ValueError(f"{name}.{label}: contains NaN or Inf; its signs are undefined")
    signs = pack_factor_signs(latent_a, latent_b)
    return PackedLoRDBA(
        in_features=latent_a.shape[1],
        out_features=latent_b.shape[0],
        signs_a=signs.a.cpu(),
        signs_b=signs.b.cpu(),
        scale_in=None if scale_in is None else _fp16_scale(scale_in, f"{name}.scale_in"),
        scale_rank=_fp16_scale(scale_rank, f"{name}.scale_rank"),
        scale_out=_fp16_scale(scale_out, f"{name}.scale_out"),
        scaling=scaling,
        latent_rms_a=rms[0],
        latent_rms_b=rms[1],
    )


def pack_adapter(module: LoRDBALinear, name: str = "adapter") -> PackedLoRDBA:
    """The storable form of ``module``'s adapter (scales rounded to fp16)."""
    return _pack(
        name,
        module.latent_a,
        module.latent_b,
        module.scale_in,
        module.scale_rank,
        module.scale_out,
        module.scaling,
        (module.latent_rms_a, module.latent_rms_b),
    )


def pack_fit(fit: LoRDBAFit, name: str = "adapter") -> PackedLoRDBA:
    """The storable form of a LoRA fit (its scaling is folded into ``scale_out``)."""
    rms = (latent_rms(fit.latent_a), latent_rms(fit.latent_b))
    return _pack(
        name, fit.latent_a, fit.latent_b, fit.scale_in, fit.scale_rank, fit.scale_out, 1.0, rms
    )


def _adapters(
    source: nn.Module | Mapping[str, LoRDBALinear | PackedLoRDBA],
) -> dict[str, PackedLoRDBA]:
    if isinstance(source, nn.Module):
        items = [(n, m) for n, m in source.named_modules() if isinstance(m, LoRDBALinear)]
    else:
        items = list(source.items())
    if not items:
        raise ValueError("nothing to save: no LoRDBALinear module found")
    adapters = {}
    for name, item in items:
        adapters[name] = (
            item if isinstance(item, PackedLoRDBA) else pack_adapter(item, name or "adapter")
        )
        adapters[name].validate(name or "adapter")
    return adapters


def _prefix(name: str) -> str:
    return f"{name}." if name else ""


def save_lordba(
    source: nn.Module | Mapping[str, LoRDBALinear | PackedLoRDBA], path: str | os.PathLike
) -> int:
    """Write every LoRDBA adapter of ``source`` (a model, or ``{name: module or packed}``) to a
    safetensors file, atomically. Returns the bytes written."""
    adapters = _adapters(source)
    tensors: dict[str, torch.Tensor] = {}
    for name, packed in adapters.items():
        tensors.update(packed.tensors(_prefix(name)))
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "modules": json.dumps({name: p.record() for name, p in adapters.items()}, sort_keys=True),
    }
    payload = safetensors.torch.save(tensors, metadata=metadata)
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(payload)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return len(payload)


def _read_file(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    try:
        with safetensors.safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    except FileNotFoundError:
        raise
    except Exception as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from error
    return metadata, tensors


def read_lordba(path: str | os.PathLike) -> dict[str, PackedLoRDBA]:
    """Read and fully validate a LoRDBA file: ``{module name: PackedLoRDBA}``."""
    path = Path(path)
    metadata, tensors = _read_file(path)
    if metadata.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: format is {metadata.get('format')!r}, expected {FORMAT_NAME!r}")
    if metadata.get("format_version") != str(FORMAT_VERSION):
        raise ValueError(
            f"{path}: format_version {metadata.get('format_version')!r} is not supported "
            f"(this loka-mods reads version {FORMAT_VERSION})"
        )
    try:
        records = json.loads(metadata["modules"])
    except (KeyError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: missing or unreadable 'modules' metadata") from error
    adapters: dict[str, PackedLoRDBA] = {}
    expected_keys: set[str] = set()
    for name, record in records.items():
        prefix = _prefix(name)
        keys = [k for k in _TENSORS if k != "scale_in" or record.get("input_scale")]
        missing = [prefix + k for k in keys if prefix + k not in tensors]
        if missing:
            raise ValueError(f"{path}: missing tensors {missing}")
        expected_keys.update(prefix + k for k in keys)
        try:
            packed = PackedLoRDBA(
                in_features=int(record["in_features"]),
                out_features=int(record["out_features"]),
                signs_a=tensors[prefix + "signs_a"],
                signs_b=tensors[prefix + "signs_b"],
                scale_in=tensors.get(prefix + "scale_in") if record["input_scale"] else None,
                scale_rank=tensors[prefix + "scale_rank"],
                scale_out=tensors[prefix + "scale_out"],
                scaling=float(record["scaling"]),
                latent_rms_a=float(record["latent_rms_a"]),
                latent_rms_b=float(record["latent_rms_b"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}: bad metadata for module {name!r}: {error}") from error
        if packed.rank != int(record["rank"]):
            raise ValueError(
                f"{path}: {name or 'adapter'} declares rank {record['rank']} but scale_rank has "
                f"{packed.rank} entries"
            )
        if not all(
            math.isfinite(v) for v in (packed.scaling, packed.latent_rms_a, packed.latent_rms_b)
        ):
            raise ValueError(f"{path}: non-finite scaling or latent RMS for {name!r}")
        try:
            packed.validate(name or "adapter")
        except (TypeError, ValueError) as error:
            raise type(error)(f"{path}: {error}") from error
        adapters[name] = packed
    unexpected = sorted(set(tensors) - expected_keys)
    if unexpected:
        raise ValueError(f"{path}: unexpected tensors {unexpected}")
    return adapters


def _check_base(base: nn.Module, packed: PackedLoRDBA, name: str) -> None:
    features = base_features(base)
    if features != (packed.in_features, packed.out_features):
        raise ValueError(
            f"{name}: adapter is for [{packed.in_features} -> {packed.out_features}], the base "
            f"module is [{features[0]} -> {features[1]}]"
        )


@torch.no_grad()
def adapter_from_packed(
    base: nn.Module, packed: PackedLoRDBA, config: LoRDBAConfig | None = None, name: str = "adapter"
) -> LoRDBALinear:
    """A :class:`LoRDBALinear` over ``base`` whose forward is exactly the stored adapter's.

    Rank, input scale and scaling come from ``packed``; backend and ste_clip from ``config``.
    """
    config = replace(
        config or LoRDBAConfig(),
        rank=packed.rank,
        input_scale=packed.scale_in is not None,
        scaling=packed.scaling,
    )
    _check_base(base, packed, name)
    packed.validate(name)
    module = LoRDBALinear(base, config)
    device = module.latent_a.device
    module.latent_a.copy_(unpack_signs(packed.signs_a, packed.in_features) * packed.latent_rms_a)
    module.latent_b.copy_(unpack_signs(packed.signs_b, packed.out_features).T * packed.latent_rms_b)
    if module.scale_in is not None:
        module.scale_in.copy_(packed.scale_in.to(device))
    module.scale_rank.copy_(packed.scale_rank.to(device))
    module.scale_out.copy_(packed.scale_out.to(device))
    module.latent_rms_a, module.latent_rms_b = packed.latent_rms_a, packed.latent_rms_b
    return module


def load_lordba(
    model: nn.Module, path: str | os.PathLike, config: LoRDBAConfig | None = None
) -> nn.Module:
    """Attach the adapters of a LoRDBA file to ``model``: each named module (a base linear, or
    an existing :class:`LoRDBALinear`, whose base is reused) is replaced by a loaded adapter.

    Everything is read and checked before the model changes; a failure leaves it as it was.
    Returns the model (the new root when the file's adapter is for the model itself).
    """
    adapters = read_lordba(path)
    bases: dict[str, nn.Module] = {}
    for name, packed in adapters.items():
        try:
            target = model.get_submodule(name)
        except AttributeError as error:
            raise ValueError(
                f"{path}: adapter for {name!r}, but the model has no such module"
            ) from error
        base = target.base if isinstance(target, LoRDBALinear) else target
        _check_base(base, packed, name or "adapter")
        bases[name] = base
    replacements = {
        name: adapter_from_packed(bases[name], packed, config, name or "adapter")
        for name, packed in adapters.items()
    }
    return replace_modules(model, replacements)
