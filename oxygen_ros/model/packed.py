"""Linears on weights prepacked for oneDNN (bfloat16 on the CPU), beside or in place of the plain.

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

What packs (Pi05Model.pack_linears, chosen by engine/prepare.py):
  * a model whose passes compile (pi05-cpu): the vision tower's layers, the backbone
    (prefill, extend, decode), the LM head and, where the op's C++ kernel is built, the
    expert, a copy beside the plain weights (47 MB with the few-row copies); through the
    Python kernel the expert's ten-row matmuls stay plain (its per-call cost is what the
    reorder saves);
  * a model too big to compile (pi05, eager): the vision tower's, the backbone's and the
    expert's layers, in place: the packed copy replaces the plain weight (a meta tensor keeps
    its shape), since a second copy would be gigabytes. Eager `linear` finds it by the tensor
    itself; a gradient (guided real-time chunking) runs on the values unpacked again; a
    decode step's 1-4 rows are read from the copy where it lies by packed_linear.cpp's
    blocked_rows, where the copy's layout is the one it knows (checked at pack time).
The vision tower's linears carry a bias: oneDNN adds it inside the product (in float32,
rounded once), where the plain path's addmm first copied it into the output (pi05's vision
pass, eager: 464 -> 408 ms side by side; at pi05-cpu's size no change a pass shows).

Compiled graphs call the op's C++ kernel where `use_native_kernel` could build it
(packed_linear.cpp, the same registry kept in C++: no Python frame or GIL per call), else
its Python kernel here. Where the CPU has AVX512-BF16, the C++ kernel also keeps a second
copy of each weight for a few-row kernel of its own (a denoise step's 10 rows, a decode
step's batch), cheaper than oneDNN's ~16 us per call: +22 MB at pi05-cpu, decode b1 0.8x.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref

import torch
from torch import nn
import torch.nn.functional as F

from . import packed_native

logger = logging.getLogger(__name__)


# The row count oneDNN is told to pack for. A weight packed for 1 row (a GEMV's layout) runs a
# prefill's 555 rows at 0.6-0.85x the speed of the plain weight (pi05's 2048->2560 3.2 ms vs
# 2.5; 16384->2048 27 vs 17, 2 threads, AMX Xeon); packed for 16 rows or more, the same
# products take 1.9 and 15.5 ms, while 1 and 10 rows keep the GEMV layout's times (within 5%).
PACK_FOR_ROWS = 64


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """Return oneDNN's packed copy of a bf16 weight [N, K] (an mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)


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
    native: bool = False         # also in the C++ kernel's registry (same key)
    few_rows: bool = True        # the C++ kernel keeps its few-row copy too
    blocked_rows: bool = False   # in place, and blocked_rows reads the copy (layout checked)

    def matches(self, weight: torch.Tensor) -> bool:
        """Say whether `weight` is the tensor packed, unchanged (no view, no in-place write)."""
        original = self.weight()
        if weight.is_meta:   # released in place: the very tensor, nothing written since
            return original is weight and _version(weight) == self.version
        return (original is not None and original.data_ptr() == weight.data_ptr()
                and tuple(weight.shape) == self.shape and tuple(weight.stride()) == self.stride
                and weight.dtype == original.dtype and _version(weight) == self.version)


class PackedLinears:
    """Packed copies of plain weights, found by the plain weight's address.

    The address is only a key: an entry is used when the weight is still alive, has the
    packed shape and strides (a view that starts at the same address, q_proj's rows of the
    fused q/k/v, does not match) and its version has not moved since. A weight released in
    place (its data moved to the meta device, only the packed copy holding the values) is
    found by the tensor itself.
    """

    def __init__(self):
        self._entries: dict[int, _Entry] = {}
        # Reentrant: a dead weight's finalizer (_forget) can run inside a call made while it
        # is held (the garbage collector runs on any allocation, e.g. in the op `_add` calls);
        # its entry check keeps it from touching an entry that took the same key since.
        self._lock = threading.RLock()
        self.python_stale_calls = 0   # Python calls whose weight had no valid packed copy
        self._layouts: dict[tuple[int, ...], bool] = {}   # shape -> blocked_rows reads it

    @property
    def stale_calls(self) -> int:
        """Calls whose weight had no valid packed copy (they ran F.linear), both kernels."""
        native = torch.ops.oxygen_packed_native.stale_calls() if packed_native.loaded() else 0
        return self.python_stale_calls + native

    def pack(self, weight: torch.Tensor, few_rows: bool = True) -> int:
        """Pack `weight` [N, K] (bf16, CPU); return the bytes its packed copies hold.

        few_rows False: no copy for the C++ kernel's few-row product (a weight that only
        many rows multiply, the vision tower's).
        """
        return self._add(weight, reorder(weight), few_rows)

    def pack_in_place(self, module: nn.Module, name: str) -> int:
        """Pack `module`'s weight `name` and put a meta tensor of its shape in its place.

        The packed copy is then the only one in memory; only `linear` in eager mode uses it.
        """
        weight = getattr(module, name)
        packed = reorder(weight)
        blocked = self._blocked_layout(weight, packed)   # while the plain values exist
        release(module, name)
        return self._add(getattr(module, name), packed, blocked_rows=blocked)

    def _blocked_layout(self, weight: torch.Tensor, packed: torch.Tensor) -> bool:
        # oneDNN lays a shape out one way: its first copy is compared with the plain values
        # in full (~3 GB/s, a third of a second for full pi05's 4 backbone shapes), the
        # others of that shape at three pairs of every block
        if not packed_native.ready('blocked_rows'):
            return False
        shape = tuple(weight.shape)
        known = self._layouts.get(shape)
        if known is False:
            return False
        matches = torch.ops.oxygen_packed_native.blocked_layout_matches(
            weight, packed, full=known is None)
        if known is None:
            self._layouts[shape] = matches
        return matches

    def _add(self, weight: torch.Tensor, packed: torch.Tensor, few_rows: bool = True,
             blocked_rows: bool = False) -> int:
        # The entry follows the weight itself (a detached alias would die at once).
        key = id(weight) if weight.is_meta else weight.data_ptr()
        entry = _Entry(weakref.ref(weight), tuple(weight.shape), tuple(weight.stride()),
                       _version(weight), packed, few_rows=few_rows, blocked_rows=blocked_rows)
        few_row_bytes = 0   # the C++ kernel's copy for few rows, where it keeps one
        with self._lock:
            self._entries[key] = entry
            if packed_native.loaded() and not weight.is_meta:
                few_row_bytes = torch.ops.oxygen_packed_native.remember(weight, packed, few_rows)
                entry.native = True
        weakref.finalize(weight, self._forget, key, entry)
        return weight.numel() * weight.element_size() + few_row_bytes

    def _forget(self, key: int, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]
                if entry.native:   # a meta weight's key is its id(), never the kernel's
                    torch.ops.oxygen_packed_native.forget(key)

    def share_with_native(self) -> None:
        """Give the C++ kernel's registry every live copy packed so far (meta ones are eager's)."""
        with self._lock:
            for entry in self._entries.values():
                weight = entry.weight()
                if weight is not None and not weight.is_meta and entry.matches(weight):
                    torch.ops.oxygen_packed_native.remember(weight, entry.packed,
                                                            entry.few_rows)
                    entry.native = True

    def lookup(self, weight: torch.Tensor) -> torch.Tensor | None:
        """Return the packed copy of `weight`, or None when there is no valid one."""
        entry = self.entry(weight)
        return entry.packed if entry is not None else None

    def entry(self, weight: torch.Tensor) -> _Entry | None:
        """Return the entry of `weight`'s packed copy, or None when there is no valid one."""
        entry = self._entries.get(id(weight) if weight.is_meta else weight.data_ptr())
        return entry if entry is not None and entry.matches(weight) else None

    def blocked_rows_copies(self, weights) -> int:
        """Count the `weights` packed in place whose copy blocked_rows reads (layout checked)."""
        return sum(bool(entry and entry.blocked_rows) for entry in map(self.entry, weights))

    def __len__(self) -> int:
        return len(self._entries)


def release(module: nn.Module, name: str) -> None:
    """Replace `module`'s tensor `name` by a meta tensor of its shape (its memory is freed)."""
    tensor = getattr(module, name)
    meta = torch.empty_like(tensor, device='meta')
    if isinstance(tensor, nn.Parameter):
        meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
    setattr(module, name, meta)


PACKED = PackedLinears()


def pack_fused(module: nn.Module, fused: str, other: nn.Linear, views: tuple[nn.Linear, ...],
               in_place: bool, few_rows: bool = True) -> int:
    """Pack `module`'s fused weight `fused` and `other`'s weight; return the bytes packed.

    in_place: the packed copies replace them, and `views` (the linears whose weights are
    views of the fused one, which would keep its storage alive) are released too.
    few_rows: see PackedLinears.pack (a copy in place is eager's: the C++ kernel never
    sees it).
    """
    if not in_place:
        return (PACKED.pack(getattr(module, fused), few_rows)
                + PACKED.pack(other.weight, few_rows))
    packed = PACKED.pack_in_place(module, fused) + PACKED.pack_in_place(other, 'weight')
    for view in views:
        release(view, 'weight')
    return packed


_LINEAR_SCHEMA = 'linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor'
_library = torch.library.Library('oxygen_packed', 'DEF')
_library.define(_LINEAR_SCHEMA)
packed_native.tag_compile_cache(_LINEAR_SCHEMA)   # a graph cached against other ops recompiles


def _packed_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    packed = PACKED.lookup(weight)
    if packed is None:
        if not PACKED.python_stale_calls:
            logger.warning('a packed linear ran unpacked: its weight %s changed (or was never '
                           'packed) after configure; results stay exact, only slower',
                           tuple(weight.shape))
        PACKED.python_stale_calls += 1
        return F.linear(x, weight, bias)
    return _packed_matmul(x, packed, weight.shape[0], bias)


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    # the bias goes into oneDNN's product: added in float32, rounded once
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, 'none', [], '')
    return out.view(*x.shape[:-1], out_features)


_library.impl('linear', _packed_linear, 'CPU')


@torch.library.register_fake('oxygen_packed::linear')
def _packed_linear_fake(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _gated_gelu_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


def gated_in_one_pass(x: torch.Tensor, weight: torch.Tensor, packed: bool) -> bool:
    """Say whether gate/up and the gated GELU run as one pass (packed_linear.cpp gated_gelu).

    Where the C++ kernel is loaded and the CPU has AMX (packed_native.ready), for a bf16
    fused weight packed beside its plain copy (the kernel reads its pair copy; in place there
    is none) and no gradient; the caller adds its own row threshold.
    """
    return (packed and x.dtype == torch.bfloat16 and x.device.type == 'cpu'
            and not weight.is_meta and packed_native.ready('gated_gelu')
            and not (torch.is_grad_enabled() and x.requires_grad))


# Rows blocked_rows serves (packed_linear.cpp kBlockedRows): full pi05's decode steps on its
# backbone packed in place. oneDNN's product for 1-4 rows streamed the copy at 17-22 GB/s, the
# kernel at 24-33 (2 threads, AMD EPYC; docs/bench/phases.md).
BLOCKED_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor, packed: bool,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Return x [..., K] @ weight [N, K]^T (+ bias [N]), through the packed copy when `packed`.

    Eager, the copy is looked up here (no op dispatch); traced, the op does it at run time.
    """
    if not packed:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        if packed_native.loaded():
            return torch.ops.oxygen_packed_native.linear(x, weight, bias)
        return torch.ops.oxygen_packed.linear(x, weight, bias)
    entry = PACKED.entry(weight)
    if entry is None:
        if weight.is_meta:
            raise RuntimeError(f'a linear weight {tuple(weight.shape)} was released into its '
                               'packed copy at configure and then changed or dropped: its values '
                               'are gone (build and prepare the model again to change weights)')
        return _packed_linear(x, weight, bias)   # the plain weight, logged once
    copy = entry.packed
    if x.requires_grad and torch.is_grad_enabled():
        # oneDNN's packed product has no gradient (guided real-time chunking takes one
        # through the expert): the plain values, unpacked again where they were released.
        return F.linear(x, copy.to_dense() if weight.is_meta else weight, bias)
    if (entry.blocked_rows and bias is None and x.dtype == torch.bfloat16
            and 0 < x.numel() <= BLOCKED_ROWS * x.shape[-1]
            and packed_native.ready('blocked_rows')):
        # a decode step's rows on a copy packed in place: read where it lies (C++ kernel)
        return torch.ops.oxygen_packed_native.blocked_rows(x, copy, weight.shape[0])
    return _packed_matmul(x, copy, weight.shape[0], bias)


PLAIN_ROWS = 8   # rows plain_linear reads a weight once for (packed_linear.cpp kPlainRows)


def plain_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Return x [..., K] @ weight [N, K]^T for a plain bf16 weight with no packed copy.

    Up to PLAIN_ROWS rows read it where it lies through the C++ kernel (packed_linear.cpp
    plain_rows, AVX512-BF16): full pi05's tied LM head, 1 GB that is also the embedding, in
    20-46 ms against ATen's 43-62 for 1 to 8 rows (2 threads, AMD EPYC). Elsewhere (more
    rows, another dtype or device, a gradient, a traced pass, the library not loaded)
    F.linear.
    """
    if (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == 'cpu'
            and x.numel() <= PLAIN_ROWS * x.shape[-1] and weight.shape[1] % 32 == 0
            and weight.is_contiguous() and packed_native.ready('plain_rows')
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return torch.ops.oxygen_packed_native.plain_rows(x, weight)
    return F.linear(x, weight)


def use_native_kernel(cache_dir) -> str | None:
    """Build (once, cached in cache_dir) and load the op's C++ kernel; None, or why not.

    From then on traced graphs call oxygen_packed_native::linear and every copy packed is
    registered with it too. Call before tracing (prepare_model does, at configure).
    """
    if packed_native.loaded():
        return None
    why = packed_native.load(cache_dir)
    if why:
        return why
    torch.library.register_fake('oxygen_packed_native::linear')(_packed_linear_fake)
    torch.library.register_fake('oxygen_packed_native::gated_gelu')(_gated_gelu_fake)
    PACKED.share_with_native()
    return None


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
