"""Hugging Face Hub model ids: a model or tokenizer argument that is not a local folder, downloaded to one.

``EngineArgs.create_engine_config`` calls :func:`~vllite.plugins.hf_hub.resolve.resolve_model_paths` once, in the
frontend, before any engine process starts; the engine config then names local snapshot folders only, so no engine
process (``-dp N`` included) downloads anything. ``resolve`` picks the files (config, safetensors weights, tokenizer,
generation config) and calls ``huggingface_hub.snapshot_download``; ``errors`` turns the Hub's failures (a missing
repository or revision, a gated one, offline without a cached copy) into one-line ``ModelLoadError``\\ s.
"""
