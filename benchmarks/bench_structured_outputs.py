"""Structured-output overhead: 256 JSON-schema requests vs the same requests unconstrained, tokens/s.

    python benchmarks/bench_structured_outputs.py                       # tiny and ~30M Llama, xgrammar, 3 rounds
    python benchmarks/bench_structured_outputs.py --presets tiny --backend guidance --rounds 5
    python benchmarks/bench_structured_outputs.py --validity 200        # + the 200-sample validity check
    python benchmarks/bench_structured_outputs.py --vllm-python /tmp/vllm-venv/bin/python   # + vLLM's CPU build

The constrained run samples (temperature 1, whitespace disabled) ``--num-requests`` answers to a nested JSON schema;
its per-request output lengths then fix the unconstrained run's (``max_tokens`` = that length, ``ignore_eos``), so
both runs generate exactly the same number of tokens and the ratio of their tokens/s is the cost of the
constraint: grammar compilation (one schema, so one compile, cached), the bitmask filled while the model runs, its
application before sampling and the matcher advanced per token. A warm-up round goes first; the variants then
alternate for ``--rounds`` rounds and medians are reported (a shared machine swings by 15%). Overhead =
unconstrained tokens/s / constrained tokens/s - 1 (target: <= 15%).

``--vllm-python PATH`` also runs the same workload on vLLM (float32, in-process engine like vllite here, the same
backend, prompts, schema, seeds and ``max_tokens`` cap; its unconstrained run takes the lengths of vLLM's own
constrained run) in a child process whose rounds alternate with vllite's, and reports vLLM's tokens/s both ways,
its overhead and the vllite/vLLM ratios. The child drops the ``vllm.logits_processors`` entry points before vLLM
loads (vLLM has no setting for that): vllite's example plugin ``vllite-force-token`` registers one there, and vLLM
would otherwise run it on every step.

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
from typing import NoReturn

os.environ.setdefault("VLLITE_ENABLE_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _common as common  # noqa: E402  (after the path set-up)
from bench_throughput import VLLM_CHILD_PRELUDE  # noqa: E402

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


_VLLM_CHILD = (
    VLLM_CHILD_PRELUDE
    + r"""
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.sample.logits_processor import _load_logitsprocs_plugins

assert not _load_logitsprocs_plugins()
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["model"], dtype="float32", max_model_len=512, max_num_seqs=cfg["max_num_seqs"], seed=0,
          gpu_memory_utilization=0.25,  # on CPU: the share of RAM for the KV cache (default 0.92)
          structured_outputs_config={"backend": cfg["backend"], "disable_any_whitespace": True})
prompts = [f"Record {i}:" for i in range(cfg["num_requests"])]
constraint = StructuredOutputsParams(json=cfg["schema"], disable_any_whitespace=True)
constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=cfg["max_tokens"], structured_outputs=constraint)
               for i in range(len(prompts))]
plain = None
print("READY", flush=True)
for line in sys.stdin:
    kind = json.loads(line)
    start = time.perf_counter()
    outs = llm.generate(prompts, constrained if kind == "constrained" else plain, use_tqdm=False)
    elapsed = time.perf_counter() - start
    outs = [o.outputs[0] for o in outs]
    lengths = [len(o.token_ids) for o in outs]
    if plain is None:  # the first constrained run fixes the unconstrained lengths
        plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    valid = 0
    for o in outs:
        try:
            json.loads(o.text)
            valid += 1
        except ValueError:
            pass
    result = {"seconds": elapsed, "tokens": sum(lengths), "stopped": sum(o.finish_reason == "stop" for o in outs),
              "strict_json": valid}
    print("RESULT", json.dumps(result), flush=True)
"""
)


class VllmChild(common.LineChild):
    """vLLM's offline ``LLM`` in a child process running ``--vllm-python``; one workload per request."""

    def __init__(self, path: str, args: argparse.Namespace) -> None:
        cfg = {
            "model": path,
            "backend": args.backend,
            "schema": SCHEMA,
            "num_requests": args.num_requests,
            "max_tokens": args.max_tokens,
            "max_num_seqs": args.max_num_seqs,
        }
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        self.log = None if args.verbose_peers else tempfile.TemporaryFile("w+")  # noqa: SIM115 (kept open while the child runs)
        super().__init__([args.vllm_python, "-c", _VLLM_CHILD, json.dumps(cfg)], stderr=self.log, env=env)
        self.expect("READY")

    def exited(self, tag: str) -> NoReturn:
        code = self.proc.wait()
        errors = ["see its log (--verbose-peers)"]
        if self.log is not None:
            self.log.seek(0)
            errors = [line.strip() for line in self.log if "Error" in line] or errors
        raise RuntimeError(f"vLLM's child exited (code {code}): {errors[-1]}")

    def __call__(self, kind: str) -> dict:
        self.send(json.dumps(kind))
        return json.loads(self.expect("RESULT"))

    def close(self, timeout: float = 60) -> None:
        super().close(timeout)
        if self.log is not None:
            self.log.close()


def start_vllm(path: str, args: argparse.Namespace) -> tuple[VllmChild | None, str | None, dict]:
    """vLLM's child on ``path``, warmed up, if asked: ``(child, None, its first constrained run)``, or ``(None,
    why not, {})`` where it could not run."""
    if not args.vllm_python:
        return None, None, {}
    try:
        vllm = VllmChild(path, args)
        first = vllm("constrained")  # warm-up; also fixes vLLM's unconstrained lengths
        vllm("unconstrained")
        return vllm, None, first
    except RuntimeError as e:  # e.g. its CPU attention has no kernel for the tiny model's head size (16)
        print(f"  vLLM skipped: {e}", file=sys.stderr, flush=True)
        return None, str(e), {}


def run(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0] for o in outputs]


def bench_model(path: str, args: argparse.Namespace) -> dict:
    """Median tokens/s of the constrained and the unconstrained runs on one model (and on vLLM, if asked)."""
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
    vllm, vllm_error, vllm_first = start_vllm(path, args)
    rates: dict[str, list[float]] = {k: [] for k in ("constrained", "unconstrained")}
    rates |= {f"vllm_{k}": [] for k in ("constrained", "unconstrained")} if vllm is not None else {}
    stopped = 0
    vllm_last: dict = {}
    try:
        for i in range(args.rounds):
            seconds, outs = run(llm, prompts, constrained)
            stopped = sum(o.finish_reason == "stop" for o in outs)
            rates["constrained"].append(sum(len(o.token_ids) for o in outs) / seconds)
            seconds, outs = run(llm, prompts, plain)
            rates["unconstrained"].append(sum(len(o.token_ids) for o in outs) / seconds)
            if vllm is not None:
                for kind in ("constrained", "unconstrained"):
                    vllm_last[kind] = vllm(kind)
                    rates[f"vllm_{kind}"].append(vllm_last[kind]["tokens"] / vllm_last[kind]["seconds"])
            line = {k: round(v[-1], 1) for k, v in rates.items() if v}
            print(f"  round {i + 1}: {json.dumps(line)} tokens/s", file=sys.stderr, flush=True)
    finally:
        if vllm is not None:
            vllm.close()
        llm.llm_engine.shutdown()
    constrained_rate = statistics.median(rates["constrained"])
    plain_rate = statistics.median(rates["unconstrained"])
    result = {
        "output_tokens": tokens,
        "constrained_tok_s": round(constrained_rate, 1),
        "unconstrained_tok_s": round(plain_rate, 1),
        "overhead": round(plain_rate / constrained_rate - 1, 3),
        "finished_with_stop": f"{stopped}/{args.num_requests}",
    }
    if vllm_error is not None:
        result["vllm"] = vllm_error
    if vllm is not None:
        result |= vllm_result(rates, vllm_first, vllm_last["constrained"], args.num_requests)
    return result


def vllm_result(rates: dict[str, list[float]], first: dict, last: dict, num_requests: int) -> dict:
    """vLLM's figures (``first`` and ``last``: its first and last constrained runs) and vllite's rates over its."""
    vllm_constrained = statistics.median(rates["vllm_constrained"])
    vllm_plain = statistics.median(rates["vllm_unconstrained"])
    return {
        "vllm": {
            "output_tokens": first["tokens"],
            "constrained_tok_s": round(vllm_constrained, 1),
            "unconstrained_tok_s": round(vllm_plain, 1),
            "overhead": round(vllm_plain / vllm_constrained - 1, 3),
            "finished_with_stop": f"{last['stopped']}/{num_requests}",
            "strict_json_loads_ok": f"{last['strict_json']}/{num_requests}",
        },
        "vllite_over_vllm": {
            "constrained": round(statistics.median(rates["constrained"]) / vllm_constrained, 2),
            "unconstrained": round(statistics.median(rates["unconstrained"]) / vllm_plain, 2),
        },
    }


def validity(path: str, n: int, lax: bool) -> dict:
    """Per backend and constraint kind: outputs (of ``n``) that are invalid or did not stop."""
    from test_structured_output_engine import CASES

    from vllite import LLM, SamplingParams

    if lax:
        import vllite.plugins.structured_outputs.xgrammar_backend as xgrammar_backend

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
    common.add_vllm_args(
        parser, python_help="a python with vLLM installed: also run vLLM", log_help="show the vLLM child's log"
    )
    args = parser.parse_args()

    from vllite.testing.models import make_model, make_tiny_model_dir_cached

    results: dict = {"backend": args.backend, "num_requests": args.num_requests, "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in filter(None, args.presets.split(",")):
            path = str(make_model(Path(tmp) / preset, preset=preset))
            results[preset] = bench_model(path, args)
            print(json.dumps({preset: results[preset]}), flush=True)
    if args.validity:
        results["validity"] = validity(str(make_tiny_model_dir_cached("llama")), args.validity, args.lax_xgrammar)
    results["load_after"] = os.getloadavg()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
