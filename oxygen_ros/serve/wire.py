"""openpi's wire format: msgpack with numpy arrays as maps of raw bytes, dtype and shape.

openpi-client packs every numpy array as a map {b'__ndarray__': True, b'data': raw bytes,
b'dtype': dtype.str, b'shape': [...]} and every numpy scalar as {b'__npgeneric__': True,
b'data': value, b'dtype': dtype.str}; everything else is plain msgpack. Object, void and
complex arrays are refused (they would need pickle). Unpacked arrays share the message's
buffer and are read-only.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np

ARRAY = b'__ndarray__'
SCALAR = b'__npgeneric__'
REFUSED_KINDS = 'VOc'        # void, object, complex


class WireError(ValueError):
    """A message that is not openpi's msgpack encoding; the message says what was wrong."""


def _encode(obj):
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in REFUSED_KINDS:
        raise WireError(f'cannot send dtype {obj.dtype} (object, void and complex are refused)')
    if isinstance(obj, np.ndarray):
        return {ARRAY: True, b'data': np.ascontiguousarray(obj).tobytes(),
                b'dtype': obj.dtype.str, b'shape': list(obj.shape)}
    if isinstance(obj, np.generic):
        return {SCALAR: True, b'data': obj.item(), b'dtype': obj.dtype.str}
    raise TypeError(f'cannot pack {type(obj).__name__}')


def _dtype(value) -> np.dtype:
    try:
        dtype = np.dtype(value.decode() if isinstance(value, bytes) else value)
    except (TypeError, ValueError, UnicodeDecodeError):
        raise WireError(f'array dtype {value!r} is not a numpy dtype') from None
    if dtype.kind in REFUSED_KINDS:
        raise WireError(f'array dtype {dtype} refused (object, void and complex need pickle)')
    return dtype


def _decode(obj: dict):
    if ARRAY in obj:
        dtype = _dtype(obj.get(b'dtype'))
        shape, data = obj.get(b'shape'), obj.get(b'data')
        if (not isinstance(shape, (list, tuple))
                or not all(isinstance(n, int) and n >= 0 for n in shape)):
            raise WireError(f'array shape {shape!r}; expected a list of sizes >= 0')
        if not isinstance(data, bytes) or len(data) != math.prod(shape) * dtype.itemsize:
            size = len(data) if isinstance(data, bytes) else type(data).__name__
            raise WireError(f'array of shape {list(shape)} and dtype {dtype} needs '
                            f'{math.prod(shape) * dtype.itemsize} bytes, got {size}')
        return np.ndarray(buffer=data, dtype=dtype, shape=tuple(shape))
    if SCALAR in obj:
        return _dtype(obj.get(b'dtype')).type(obj.get(b'data'))
    return obj


def packb(obj) -> bytes:
    """Encode `obj` (dicts, lists, str, numbers, numpy arrays and scalars) as openpi does."""
    return msgpack.packb(obj, default=_encode)


def unpackb(data: bytes):
    """Decode one message; raise WireError when it is not openpi's encoding."""
    try:
        return msgpack.unpackb(data, object_hook=_decode)
    except WireError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as err:
        raise WireError(f'not a msgpack message: {err}') from None
