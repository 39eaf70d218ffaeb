"""The identity of the machine a `kernel_bench` row was measured on.

Kernel times depend on the GPU, its driver and the torch and triton builds that generated
the kernels; a cached time is reused only where all five match.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

__all__ = [
    "DeviceInfo",
]

FINGERPRINT_COLUMNS = ("device", "capability", "driver", "torch_version", "triton_version")


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "absent"
    return str(triton.__version__)


def _nvidia_driver() -> str:
    # torch exposes the CUDA runtime version but not the kernel driver's; the driver decides
    # how PTX is JIT-compiled and so can change kernel times.
    proc = Path("/proc/driver/nvidia/version")
    if proc.exists():
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", proc.read_text())
        if match:
            return match.group(1)
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.strip().splitlines()[0] if out.strip() else "unknown"


@dataclass(frozen=True)
class DeviceInfo:
    """GPU name, compute capability, driver, torch and triton versions (the cache key)."""

    device: str
    capability: str
    driver: str
    torch_version: str
    triton_version: str

    @classmethod
    def current(cls, device: torch.device | str | None = None) -> DeviceInfo:
        """The identity of `device` (default: the current CUDA device, else the CPU)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            major, minor = torch.cuda.get_device_capability(index)
            return cls(
                device=torch.cuda.get_device_name(index),
                capability=f"{major}.{minor}",
                driver=f"{_nvidia_driver()} / CUDA {torch.version.cuda}",
                torch_version=torch.__version__,
                triton_version=_triton_version(),
            )
        return cls(
            device=device.type,
            capability="none",
            driver="none",
            torch_version=torch.__version__,
            triton_version=_triton_version(),
        )

    @classmethod
    def from_row(cls, row: dict) -> DeviceInfo:
        return cls(**{f.name: str(row[f.name]) for f in fields(cls)})

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    @property
    def slug(self) -> str:
        """A file-name-safe key: the GPU name plus a hash of all five fields."""
        digest = hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()
        name = re.sub(r"[^A-Za-z0-9]+", "-", self.device).strip("-").lower() or "device"
        return f"{name}-{digest[:12]}"

    def differences(self, other: DeviceInfo) -> list[str]:
        """Human-readable `field: ours vs theirs` for every field that differs."""
        return [
            f"{f.name} {getattr(other, f.name)!r} (this machine: {getattr(self, f.name)!r})"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def describe(self) -> str:
        return (
            f"{self.device} (capability {self.capability}, driver {self.driver}, "
            f"torch {self.torch_version}, triton {self.triton_version})"
        )
