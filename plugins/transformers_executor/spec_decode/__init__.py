"""n-gram speculative decoding in the executor: the prompt-lookup drafter, the rejection sampler and the
verification step that applies logits processors and penalties per draft position.

See ``docs/speculative-decoding.md``. Enabled by ``config.speculative_config`` (``--speculative-config``).
"""
