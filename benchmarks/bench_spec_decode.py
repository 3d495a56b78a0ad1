"""n-gram speculative decoding on a repetitive code-editing workload: tokens/s and acceptance, on vs off.

    python benchmarks/bench_spec_decode.py                      # ~30M-parameter Llama, k=5, 3 rounds each
    python benchmarks/bench_spec_decode.py --model-preset tiny --rounds 5
    python benchmarks/bench_spec_decode.py --model PATH --num-speculative-tokens 3

The workload: each prompt is a source file of vllite's own (cut to ``--input-len`` tokens) with an instruction to
reproduce it with small edits (an identifier renamed, a number changed, a comment added every few lines); the
answer is the edited file, ``--output-len`` tokens at most. That is where prompt lookup shines in practice: the
answer repeats long spans of the prompt.

What is real and what is forced: the benchmark model has random weights (nothing is downloaded), so it cannot
actually perform the edit. Its output is *forced* to the edited file by ``ForcedSequenceLogitsProcessor``
(``vllite.testing.logitsprocs``, ``extra_args={"forced_token_ids": ...}``), in both modes. Every forward pass,
KV-cache write, logits processor, draft proposal and verification runs for real; only the choice of token is
dictated, exactly as a model that performs the edit would choose it. So tokens/s measures the engine's cost
per token with and without drafts, and the acceptance rate is the n-gram drafter's on a realistic edit (the
share of its proposals that match the answer), not a property of a trained model. Both engines' outputs are
checked to be the edited file.

Both engines run in this process (in-process engine core, so the scheduler's draft counters can be read) and
alternate for ``--rounds`` rounds; medians are reported, since one run on a shared machine can swing by 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (
    "core/sched/phases.py",
    "core/kv_cache/block_pool.py",
    "core/engine/stats.py",
    "core/logits_processor/container.py",
    "core/sched/updates.py",
    "core/engine/llm.py",
    "core/kv_cache/manager.py",
    "core/sched/step_state.py",
)
INSTRUCTION = (
    "Rewrite the following Python file. Rename the variable `{old}` to `{new}`, replace the number {num} by "
    "{num2}, and add a short comment line every {every} lines. Output the whole file.\n\n"
)


def edit_source(text: str, every: int) -> tuple[str, str, dict[str, str]]:
    """The edited file and the instruction for it: one identifier renamed, one number changed, a comment line
    added every ``every`` lines."""
    words = re.findall(r"\b[a-z_][a-z0-9_]{3,}\b", text)
    old = max(set(words), key=lambda w: (words.count(w), w))
    new = old.rstrip("s") + "_v2"
    numbers = re.findall(r"\b\d+\b", text) or ["0"]
    num = max(set(numbers), key=numbers.count)
    edited = re.sub(rf"\b{re.escape(old)}\b", new, text)
    edited = re.sub(rf"\b{re.escape(num)}\b", str(int(num) + 1), edited, count=1)
    lines = edited.split("\n")
    out: list[str] = []
    for i, line in enumerate(lines):
        if i and i % every == 0 and line.strip():
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}# (edited) step {i // every}")
        out.append(line)
    instruction = INSTRUCTION.format(old=old, new=new, num=num, num2=int(num) + 1, every=every)
    return "\n".join(out), instruction, {"old": old, "new": new}


def make_workload(tokenizer, args: argparse.Namespace) -> list[tuple[list[int], list[int]]]:
    """``(prompt_token_ids, answer_token_ids)`` per request."""
    cases = []
    for i in range(args.num_prompts):
        source = (ROOT / SOURCES[i % len(SOURCES)]).read_text()[: 8 * args.input_len]  # enough characters
        ids = tokenizer.encode(source, add_special_tokens=False, verbose=False)[: args.input_len]
        text = tokenizer.decode(ids)
        text = text[: text.rfind("\n") + 1] if "\n" in text else text
        edited, instruction, _ = edit_source(text, args.comment_every)
        prompt = tokenizer.encode(
            instruction + "```python\n" + text + "```\n\n```python\n", add_special_tokens=False, verbose=False
        )
        answer = tokenizer.encode(edited, add_special_tokens=False, verbose=False)[: args.output_len]
        cases.append((prompt, answer))
    return cases


class Engine:
    """One vllite engine (speculative decoding on or off), timed over the workload."""

    def __init__(self, model: str, spec: dict | None, max_model_len: int, args: argparse.Namespace) -> None:
        from vllite import LLM

        self.spec = spec
        self.llm = LLM(
            model,
            dtype=args.dtype,
            max_model_len=max_model_len,
            max_num_seqs=args.num_prompts,
            speculative_config=spec,
            logits_processors=["vllite.testing.logitsprocs:ForcedSequenceLogitsProcessor"],
        )
        self.scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]

    def run(self, cases: list[tuple[list[int], list[int]]]) -> dict:
        from vllite import SamplingParams

        params = [
            SamplingParams(temperature=0.0, max_tokens=len(a), ignore_eos=True, extra_args={"forced_token_ids": a})
            for _, a in cases
        ]
        self.llm.reset_prefix_cache()  # every round computes every prompt
        tracker = self.scheduler.spec_decoding
        totals = tracker.totals if tracker is not None else None
        before = (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens) if totals else (0, 0, 0)
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p, _ in cases], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        for output, (_, answer) in zip(outputs, cases):
            assert list(output.outputs[0].token_ids) == answer, "the output is not the forced answer"
        generated = sum(len(a) for _, a in cases)
        result = {"elapsed_s": elapsed, "tokens_per_s": generated / elapsed}
        if totals is not None:
            drafts = totals.num_drafts - before[0]
            draft_tokens = totals.num_draft_tokens - before[1]
            accepted = totals.num_accepted_tokens - before[2]
            result["acceptance_rate"] = accepted / draft_tokens if draft_tokens else 0.0
            result["mean_acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
        return result

    def shutdown(self) -> None:
        self.llm.shutdown()


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from vllite.testing import make_model

    path = Path(tempfile.gettempdir()) / f"vllite-bench-{args.model_preset}"
    if not (path / "config.json").exists():
        make_model(path, preset=args.model_preset)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a local model folder (default: a random-weight --model-preset model)")
    parser.add_argument("--model-preset", default="30m", help="vllite.testing.make_model preset (30m, tiny)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=4, help="concurrent requests (one per source file)")
    parser.add_argument("--input-len", type=int, default=512, help="source tokens per prompt (at most)")
    parser.add_argument("--output-len", type=int, default=320, help="answer tokens per request (at most)")
    parser.add_argument("--comment-every", type=int, default=8, help="the edit adds a comment every N lines")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine, alternating")
    parser.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    args = parser.parse_args()
    os.environ.setdefault("VLLITE_ENABLE_MULTIPROCESSING", "0")  # read the draft counters in-process

    from transformers import AutoTokenizer

    model = resolve_model(args)
    cases = make_workload(AutoTokenizer.from_pretrained(model), args)
    max_model_len = max(len(p) + len(a) for p, a in cases) + args.num_speculative_tokens + 16
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    engines = {"off": Engine(model, None, max_model_len, args), "on": Engine(model, spec, max_model_len, args)}
    for engine in engines.values():
        engine.run(cases[:1])  # warm-up
    results: dict[str, list[dict]] = {"off": [], "on": []}
    for round_index in range(args.rounds):
        for name in ("off", "on") if round_index % 2 == 0 else ("on", "off"):
            results[name].append(engines[name].run(cases))
    for engine in engines.values():
        engine.shutdown()

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    summary = {
        "model": model,
        "num_prompts": args.num_prompts,
        "prompt_tokens": sum(len(p) for p, _ in cases),
        "output_tokens": sum(len(a) for _, a in cases),
        "speculative_config": spec,
        "rounds": args.rounds,
        "off_tokens_per_s": median("off", "tokens_per_s"),
        "on_tokens_per_s": median("on", "tokens_per_s"),
        "acceptance_rate": median("on", "acceptance_rate"),
        "mean_acceptance_length": median("on", "mean_acceptance_length"),
    }
    summary["speedup"] = summary["on_tokens_per_s"] / summary["off_tokens_per_s"]
    print(
        f"model {model}: {args.num_prompts} requests, {summary['prompt_tokens']} prompt tokens, "
        f"{summary['output_tokens']} output tokens; medians of {args.rounds} alternating rounds"
    )
    print(f"  spec decode off: {summary['off_tokens_per_s']:8.1f} tokens/s")
    print(
        f"  spec decode on : {summary['on_tokens_per_s']:8.1f} tokens/s  (k={args.num_speculative_tokens}, "
        f"n-gram {args.prompt_lookup_min}-{args.prompt_lookup_max}), acceptance {summary['acceptance_rate']:.1%}, "
        f"{summary['mean_acceptance_length']:.2f} tokens per verification"
    )
    print(f"  speed-up       : {summary['speedup']:.2f}x")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
