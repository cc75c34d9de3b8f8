"""Programmatic dependent launch (PDL, Hopper and later) for the small kernels of a decode step.

A decode step at small batch sizes is a chain of short kernels (norm, GEMV, rotary, attention, ...),
each waiting for the one before it: the next kernel's launch, block scheduling and set-up happen only
after the previous kernel's last block has finished. Launched with PDL, a kernel may start while its
predecessor is still running and waits, inside the kernel, before it touches memory
(``griddepcontrol.wait``: the prior grid has completed and its writes are visible); it then lets its own
successor launch early (``griddepcontrol.launch_dependents``).

Invariant for every kernel launched with ``launch_pdl=True``: ``pdl_prologue`` runs before the kernel's
first global store, and before its first load of anything a kernel of the running model writes. That
keeps the stream's order for data (read-after-write and write-after-read alike), whichever kernel came
before: a predecessor that never releases its dependents (cuBLAS, torch ops) simply lets the next kernel
start when it completes, as without PDL.

Loads before the wait (``PLAIT_PDL_PRELOAD``: RMSNorm, rotary, decode attention): only values no kernel
writes while the model runs (norm weights, the rotary table) and a step's inputs staged before its first
layer (positions, ``out_cache_loc``, the attention's indptr, slot lists and split counts). When a
kernel's pre-wait code runs, its predecessor has passed its own wait, so every kernel before that
predecessor has completed and its writes are visible; the staged inputs are written at least two kernels
before any reader (an embedding and a norm or projection come between), or by kernels launched without
PDL, which release no dependent before they complete.
Off on the CPU (the Triton interpreter has no grid dependency control) and below sm_90.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from plait import envs


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device launch with PDL (``PLAIT_PDL``; CUDA sm_90+ only)."""
    if t.device.type != "cuda" or not envs.PDL.get():
        return False
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())[0] >= 9


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch (module docstring)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
