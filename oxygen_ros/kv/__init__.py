"""Unified KV cache: slot pool, request state σ, batch/unbatch by index (torch only)."""

from oxygen_ros.kv.batch import DecodeBatch, build_decode_batch, unbatch
from oxygen_ros.kv.pool import KVPool
from oxygen_ros.kv.request import FINISH_REASONS, RequestState

__all__ = ['DecodeBatch', 'FINISH_REASONS', 'KVPool', 'RequestState', 'build_decode_batch',
           'unbatch']
