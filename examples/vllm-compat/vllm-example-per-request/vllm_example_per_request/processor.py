"""A per-request logits processor wrapped as a batch-level one, as vLLM's documentation shows.

``DummyPerReqLogitsProcessor`` works on one request's logits row; ``WrappedPerReqLogitsProcessor`` builds
one for each request that sets ``extra_args["target_token"]`` and lets vLLM's ``AdapterLogitsProcessor``
keep them in step with the batch. The constructor is overridden (calling the base class first) to read
engine configuration, the case vLLM's documentation covers for processors that need model metadata.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor, RequestLogitsProcessor

logger = init_logger(__name__)


class DummyPerReqLogitsProcessor:
    """Masks out every logit of one request's row except ``target_token``'s."""

    def __init__(self, target_token: int) -> None:
        self.target_token = target_token

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        kept = logits[self.target_token].item()
        logits[:] = float("-inf")
        logits[self.target_token] = kept
        return logits


class WrappedPerReqLogitsProcessor(AdapterLogitsProcessor):
    """Applies :class:`DummyPerReqLogitsProcessor` to the requests that set an in-vocabulary ``target_token``.

    A request without the argument, or with a value that is not a token id of the model, is left alone
    (with a warning for the latter).
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.vocab_size = vllm_config.model_config.get_vocab_size()

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        target_token = (params.extra_args or {}).get("target_token")
        if target_token is None:
            return None
        if not isinstance(target_token, int) or not 0 <= target_token < self.vocab_size:
            logger.warning("target_token %r is not a token id of this model; not applying it.", target_token)
            return None
        return DummyPerReqLogitsProcessor(target_token)
