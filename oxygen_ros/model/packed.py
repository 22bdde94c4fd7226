"""Backbone linears with weights prepacked for oneDNN (bfloat16 on the CPU).

A bf16 `F.linear` on the CPU hands oneDNN a plain [N, K] weight, which oneDNN reorders into
its blocked layout on every call: for a decode step's one-row GEMVs that reorder reads and
writes the weight again and costs more than the product (pi05-cpu's LM head, 1x256->16384:
330 vs 155 us; a gate/up 55 vs 33 us; docs/bench/phases.md). Reordering once, at configure,
removes it. Results are the same kernels' (bit-identical where measured); packed is never
slower at any row count, so prefill and extend use the packed weights too.

Why an op of our own: inductor's `freezing` packs weights too, but its graphs then hold
oneDNN tensors that do not pickle, so no compile cache keeps them (every configure
recompiles). Here the graph calls `oxygen_packed::linear(x, weight)` with the plain weight
(a normal graph input, cacheable); the op finds the weight's packed copy in `PackedLinears`
and falls back to `F.linear` when there is none or the weight changed since it was packed
(in place: its version moved), so a stale copy is never used.

Only the backbone packs (prefill, extend, decode, LM head): the expert's denoise matmuls are
ten rows of small weights, where the op's dispatch costs what the reorder does.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def _version(weight: torch.Tensor) -> int | None:
    try:
        return weight._version
    except RuntimeError:   # an inference-mode tensor has no version counter
        return None


@dataclasses.dataclass
class _Entry:
    weight: weakref.ref          # the plain weight this copy was packed from
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    version: int | None
    packed: torch.Tensor         # oneDNN-blocked copy (an mkldnn tensor)

    def matches(self, weight: torch.Tensor) -> bool:
        """Say whether `weight` is the tensor packed, unchanged (no view, no in-place write)."""
        original = self.weight()
        return (original is not None and original.data_ptr() == weight.data_ptr()
                and tuple(weight.shape) == self.shape and tuple(weight.stride()) == self.stride
                and weight.dtype == original.dtype and _version(weight) == self.version)


class PackedLinears:
    """Packed copies of plain weights, found by the plain weight's address.

    The address is only a key: an entry is used when the weight is still alive, has the
    packed shape and strides (a view that starts at the same address, q_proj's rows of the
    fused q/k/v, does not match) and its version has not moved since.
    """

    def __init__(self):
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()
        self.stale_calls = 0     # calls whose weight had no valid packed copy (ran F.linear)

    def pack(self, weight: torch.Tensor) -> int:
        """Pack `weight` [N, K] (bf16, CPU); return the bytes the packed copy holds."""
        # The entry follows the weight itself (a detached alias would die at once).
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        key = weight.data_ptr()
        entry = _Entry(weakref.ref(weight), tuple(weight.shape), tuple(weight.stride()),
                       _version(weight), packed)
        with self._lock:
            self._entries[key] = entry
        weakref.finalize(weight, self._forget, key, entry)
        return weight.numel() * weight.element_size()

    def _forget(self, key: int, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]

    def lookup(self, weight: torch.Tensor) -> torch.Tensor | None:
        """Return the packed copy of `weight`, or None when there is no valid one."""
        entry = self._entries.get(weight.data_ptr())
        return entry.packed if entry is not None and entry.matches(weight) else None

    def __len__(self) -> int:
        return len(self._entries)


PACKED = PackedLinears()

_library = torch.library.Library('oxygen_packed', 'DEF')
_library.define('linear(Tensor x, Tensor weight) -> Tensor')


def _packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    packed = PACKED.lookup(weight)
    if packed is None:
        if not PACKED.stale_calls:
            logger.warning('a packed linear ran unpacked: its weight %s changed (or was never '
                           'packed) after configure; results stay exact, only slower',
                           tuple(weight.shape))
        PACKED.stale_calls += 1
        return F.linear(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, None, 'none', [], '')
    return out.view(*x.shape[:-1], weight.shape[0])


_library.impl('linear', _packed_linear, 'CPU')


@torch.library.register_fake('oxygen_packed::linear')
def _packed_linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, packed: bool) -> torch.Tensor:
    """Return x [..., K] @ weight [N, K]^T, through the packed copy when `packed` (no bias)."""
    if packed:
        return torch.ops.oxygen_packed.linear(x, weight)
    return F.linear(x, weight)


def packing_unavailable_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why weights are not packed for `device` / `dtype`, or None when they can be."""
    if torch.device(device).type != 'cpu':
        return 'packing is for the CPU (a GPU reads plain weights)'
    if dtype != torch.bfloat16:
        return f'packing is for bfloat16 weights, the model computes in {dtype}'
    if not (torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return 'oneDNN has no bfloat16 support in this torch or on this CPU'
    return None
