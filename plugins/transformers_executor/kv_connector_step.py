"""One model-runner step with a worker-role KV connector around it (vLLM's ``KVConnectorModelRunnerMixin``).

Order: ``bind_connector_metadata`` → ``start_load_kv`` → the step (its attention layers call
``wait_for_layer_load`` / ``save_kv_layer``) → ``wait_for_save`` → ``get_finished``,
``get_block_ids_with_load_errors`` and ``get_kv_connector_stats`` → ``clear_connector_metadata``. Steps with nothing
scheduled go through the same calls, so asynchronous transfers are still reported. The results ride on
``ModelRunnerOutput.kv_connector_output`` (``None`` when there is nothing to report).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllite.kv_connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput

if TYPE_CHECKING:
    from vllite.sched.output import ModelRunnerOutput, SchedulerOutput


def execute_with_connector(
    connector: KVConnectorBase,
    scheduler_output: SchedulerOutput,
    run: Callable[[SchedulerOutput], ModelRunnerOutput],
) -> ModelRunnerOutput:
    """Runs ``run(scheduler_output)`` between the connector's per-step calls and attaches its results."""
    metadata = scheduler_output.kv_connector_metadata
    connector.bind_connector_metadata(metadata if metadata is not None else KVConnectorMetadata())
    try:
        connector.start_load_kv()
        output = run(scheduler_output)
        connector.wait_for_save()
        sending, recving = connector.get_finished(set(scheduler_output.finished_req_ids))
        invalid = connector.get_block_ids_with_load_errors()
        stats = connector.get_kv_connector_stats()
    finally:
        connector.clear_connector_metadata()
    kv_output = KVConnectorOutput(set(sending or ()), set(recving or ()), set(invalid or ()), stats or None)
    if kv_output.is_empty():
        return output
    return dataclasses.replace(output, kv_connector_output=kv_output)
