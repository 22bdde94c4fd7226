"""Unified KV cache: slot ids (KVPool), the tensors behind them (KVStore), request state σ."""

from oxygen_ros.kv.pool import KVPool, QuotaPool, SlotError
from oxygen_ros.kv.request import FINISH_REASONS, FinishReason, RequestState
from oxygen_ros.kv.store import KVStore

__all__ = ['FINISH_REASONS', 'FinishReason', 'KVPool', 'KVStore', 'QuotaPool', 'RequestState',
           'SlotError']
