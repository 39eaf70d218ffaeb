"""Activation checkpointing (`torch.utils.checkpoint`, non-reentrant) and state kept across
a forward and its rerun.

Checkpointing runs a region's forward twice: once in the forward pass, keeping none of its
activations, and again inside the backward, to remake them. A forward that reads and
updates state between calls (delayed scaling's amax history) must see on the rerun what it
saw on the first run, and update nothing. `region()` tells which run a forward is and of
which region; `kept_before_rerun` holds, per region and per module, what a first run kept
for its rerun, first in first out (a region reruns its forward in the original order), and
forgets a region with the region itself (a first run whose backward never comes).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["in_backward", "kept_before_rerun", "region"]

# region -> id(module) -> values kept by the module's first runs in that region, in order
_KEPT: weakref.WeakKeyDictionary[Any, dict[int, list[Any]]] = weakref.WeakKeyDictionary()


def in_backward() -> bool:
    """Whether the caller runs inside an autograd backward (where a module's forward runs
    only as checkpointing's rerun)."""
    return torch._C._current_graph_task_id() != -1


def region() -> tuple[Any | None, bool]:
    """(the checkpointed region this forward runs in, or None; whether this is its rerun
    inside the backward). Read from the saved-tensor hooks that checkpointing installs
    around each run (their closures hold the region's frame); None under other hooks (CPU
    offload, say) or none."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return None, False
    pack = hooks[0]
    # Any callable can be a pack hook (a partial, an object): only a closure can be ours.
    names = getattr(getattr(pack, "__code__", None), "co_freevars", ())
    cells = dict(zip(names, getattr(pack, "__closure__", None) or (), strict=False))
    if "target_frame_ref" in cells:  # torch.utils.checkpoint's _recomputation_hook
        return cells["target_frame_ref"].cell_contents(), True
    if "frame" in cells and not in_backward():  # its _checkpoint_hook
        return cells["frame"].cell_contents, False
    return None, False


def kept_before_rerun(frame: Any, module: Any) -> list[Any]:
    """The list (first in, first out) of what `module`'s first runs in region `frame` kept
    for their reruns."""
    return _KEPT.setdefault(frame, {}).setdefault(id(module), [])
