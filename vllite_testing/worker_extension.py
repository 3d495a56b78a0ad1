"""A worker extension class for testing ``collective_rpc`` (vLLM's ``worker_extension_cls``): select it with
``worker_extension_cls="vllite.testing.worker_extension:EchoWorkerExtension"`` (``--worker-extension-cls``)."""

from __future__ import annotations

from typing import Any


class EchoWorkerExtension:
    """Worker methods that show what a ``collective_rpc`` call delivered; other attributes are the executor's."""

    model_info: Any  # the executor's, reached through the worker

    def echo_args_kwargs(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The call's arguments, as received."""
        return {"args": list(args), "kwargs": kwargs}

    def model_max_len(self) -> int:
        """The executor's context length (an attribute the extension does not define)."""
        return int(self.model_info.max_model_len)

    def return_none(self, *args: Any, **kwargs: Any) -> None:
        """Nothing (vLLM's route then answers with an empty 200)."""
        return None
