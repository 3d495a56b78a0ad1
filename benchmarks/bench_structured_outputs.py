"""Structured-output overhead: 256 JSON-schema requests vs the same requests unconstrained, tokens/s.

    python benchmarks/bench_structured_outputs.py                       # tiny and ~30M Llama, xgrammar, 3 rounds
    python benchmarks/bench_structured_outputs.py --presets tiny --backend guidance --rounds 5
    python benchmarks/bench_structured_outputs.py --validity 200        # + the 200-sample validity check

The constrained run samples (temperature 1, whitespace disabled) ``--num-requests`` answers to a nested JSON schema;
its per-request output lengths then fix the unconstrained run's (``max_tokens`` = that length, ``ignore_eos``), so
both runs generate exactly the same number of tokens and the ratio of their tokens/s is the cost of the
constraint: grammar compilation (one schema, so one compile, cached), the bitmask filled while the model runs, its
application before sampling and the matcher advanced per token. A warm-up round goes first; the variants then
alternate for ``--rounds`` rounds and medians are reported (a shared machine swings by 15%). Overhead =
unconstrained tokens/s / constrained tokens/s - 1 (target: <= 15%).

``--validity N`` also samples N outputs per constraint kind (JSON schema, regex, choice, EBNF grammar) with each
builtin backend and counts those that are not valid (strict ``json.loads`` + ``jsonschema``, ``re.fullmatch``,
membership, the grammar's parser) or did not finish with ``stop``; ``--lax-xgrammar`` turns off the rewrite that
keeps raw control characters out of xgrammar's JSON strings, to measure what it prevents.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLITE_ENABLE_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "status": {"enum": ["active", "idle", "gone"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 4},
        "meta": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "tag": {"type": "string", "maxLength": 8}},
            "required": ["ok", "tag"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "status", "scores", "meta"],
    "additionalProperties": False,
}


def run(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0] for o in outputs]


def bench_model(path: str, args: argparse.Namespace) -> dict:
    """Median tokens/s of the constrained and the unconstrained runs on one model."""
    from vllite import LLM, SamplingParams
    from vllite.structured_output import StructuredOutputsParams

    llm = LLM(
        path,
        max_model_len=512,
        max_num_seqs=args.max_num_seqs,
        structured_outputs_config={"backend": args.backend, "disable_any_whitespace": True},
    )
    prompts = [f"Record {i}:" for i in range(args.num_requests)]
    constraint = StructuredOutputsParams(json=SCHEMA)
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=constraint)
        for i in range(args.num_requests)
    ]
    _, outputs = run(llm, prompts, constrained)  # warm-up; also fixes the lengths
    lengths = [len(o.token_ids) for o in outputs]
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    run(llm, prompts, plain)
    tokens = sum(lengths)
    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    stopped = 0
    for _ in range(args.rounds):
        seconds, outs = run(llm, prompts, constrained)
        stopped = sum(o.finish_reason == "stop" for o in outs)
        rates["constrained"].append(sum(len(o.token_ids) for o in outs) / seconds)
        seconds, outs = run(llm, prompts, plain)
        rates["unconstrained"].append(sum(len(o.token_ids) for o in outs) / seconds)
    llm.llm_engine.shutdown()
    constrained_rate = statistics.median(rates["constrained"])
    plain_rate = statistics.median(rates["unconstrained"])
    return {
        "output_tokens": tokens,
        "constrained_tok_s": round(constrained_rate, 1),
        "unconstrained_tok_s": round(plain_rate, 1),
        "overhead": round(plain_rate / constrained_rate - 1, 3),
        "finished_with_stop": f"{stopped}/{args.num_requests}",
    }


def validity(path: str, n: int, lax: bool) -> dict:
    """Per backend and constraint kind: outputs (of ``n``) that are invalid or did not stop."""
    from test_structured_output_engine import CASES

    from vllite import LLM, SamplingParams

    if lax:
        import vllite.structured_output.xgrammar_backend as xgrammar_backend

        xgrammar_backend.strict_json_ebnf = lambda ebnf: ebnf  # type: ignore[assignment]
    report: dict = {}
    for backend in ("xgrammar", "guidance"):
        llm = LLM(
            path, max_model_len=512, structured_outputs_config={"backend": backend, "disable_any_whitespace": True}
        )
        for kind, (constraint, check) in CASES.items():
            params = [
                SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=constraint) for i in range(n)
            ]
            _, outputs = run(llm, ["Give me data:"] * n, params)
            bad = sum(o.finish_reason != "stop" or not check(o.text) for o in outputs)
            report[f"{backend}/{kind}"] = f"{bad}/{n} invalid"
        llm.llm_engine.shutdown()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,30m", help="model presets (vllite.testing.models.MODEL_PRESETS)")
    parser.add_argument("--backend", default="xgrammar", choices=["xgrammar", "guidance", "auto"])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--validity", type=int, default=0, help="also check N samples per constraint and backend")
    parser.add_argument("--lax-xgrammar", action="store_true", help="validity without the strict-JSON rewrite")
    args = parser.parse_args()

    from vllite.testing.models import make_model, make_tiny_model_dir_cached

    results: dict = {"backend": args.backend, "num_requests": args.num_requests}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in filter(None, args.presets.split(",")):
            path = str(make_model(Path(tmp) / preset, preset=preset))
            results[preset] = bench_model(path, args)
            print(json.dumps({preset: results[preset]}), flush=True)
    if args.validity:
        results["validity"] = validity(str(make_tiny_model_dir_cached("llama")), args.validity, args.lax_xgrammar)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
