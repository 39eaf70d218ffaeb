"""Under torch.distributed the plan is made once, on rank 0, and broadcast: every rank
applies exactly the same plan (a rank planning alone could pick different kernels from
timing noise, and DDP needs identical modules on every rank)."""

from __future__ import annotations

import io
import json
from collections.abc import Callable

import polars as pl
import torch.distributed as dist

from loka.dispatch.planner import Plan, PlanSummary

_ERROR = b"loka-error:"


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def pack_plan(plan: Plan) -> bytes:
    buf = io.BytesIO()
    plan.table.write_ipc(buf)
    head = json.dumps({"metadata": plan.metadata, "summary": dict(plan.summary.__dict__)}).encode()
    return len(head).to_bytes(8, "little") + head + buf.getvalue()


def unpack_plan(payload: bytes) -> Plan:
    size = int.from_bytes(payload[:8], "little")
    head = json.loads(payload[8 : 8 + size])
    table = pl.read_ipc(io.BytesIO(payload[8 + size :]))
    return Plan(table, PlanSummary.from_dict(head["summary"]), head["metadata"])


def plan_once(make: Callable[[], Plan], src: int = 0) -> Plan:
    """Run `make()` on rank `src` only and return its plan on every rank (outside
    torch.distributed: just `make()`). If `make` fails on `src`, every rank raises with its
    message, so none waits forever in a collective."""
    if not is_distributed():
        return make()
    payload: list = [None]
    if dist.get_rank() == src:
        try:
            payload = [pack_plan(make())]
        except Exception as exc:
            payload = [_ERROR + f"{type(exc).__name__}: {exc}".encode()]
            dist.broadcast_object_list(payload, src=src)
            raise
    dist.broadcast_object_list(payload, src=src)
    data = payload[0]
    if data.startswith(_ERROR):
        raise RuntimeError(f"planning failed on rank {src}: {data[len(_ERROR) :].decode()}")
    return unpack_plan(data)
