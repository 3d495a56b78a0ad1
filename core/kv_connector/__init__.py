"""KV connectors: move KV blocks out of and into the engine's paged cache (offloading, sharing, disaggregation).

One connector class is built twice, once per role: the SCHEDULER role inside the scheduler (it decides which
tokens come from outside and when a finished request's blocks may be freed) and the WORKER role inside the
executor (it copies KV between the paged cache and its store, per layer, during the forward pass). The two talk
only through values: ``KVConnectorMetadata`` (scheduler to worker, once per step, on ``SchedulerOutput``) and
``KVConnectorOutput`` (worker to scheduler, on ``ModelRunnerOutput``).

Modules: ``base`` (the contract), ``config`` (``KVTransferConfig``, vLLM's ``--kv-transfer-config``),
``factory`` (selection by registered name or class path), ``scheduler_side`` (``KVTransfer``, what the scheduler
calls of the connector's transfer machinery, which the KV-connector plugin implements).
"""

from vllite.kv_connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)

__all__ = ["KVConnectorBase", "KVConnectorMetadata", "KVConnectorOutput", "KVConnectorRole"]
