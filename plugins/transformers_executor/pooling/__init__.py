"""Pooling models (embeddings, classification, scores) in the transformers executor: ``--runner pooling``."""

from vllite.plugins.transformers_executor.pooling.loader import LoadedPoolingModel, load_pooling_model
from vllite.plugins.transformers_executor.pooling.pooler import ClassificationHead, Pooler, PoolingRow
from vllite.plugins.transformers_executor.pooling.runner import PoolingModelRunner
from vllite.plugins.transformers_executor.pooling.setup import POOLING_TYPES, PoolingSetup, resolve_pooling_setup

__all__ = [
    "POOLING_TYPES",
    "ClassificationHead",
    "LoadedPoolingModel",
    "Pooler",
    "PoolingModelRunner",
    "PoolingRow",
    "PoolingSetup",
    "load_pooling_model",
    "resolve_pooling_setup",
]
