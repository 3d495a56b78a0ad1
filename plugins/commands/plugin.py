"""Builtin ``vllite`` subcommands (``plugins``, ``generate``, ``chat``), contributed through the commands hook."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

from vllite.engine.tokenizer import load_chat_template
from vllite.hookspecs import hookimpl
from vllite.plugins.commands.engine_flags import add_vllm_only_flags, check_engine_args

BUILTINS_NOTE = (
    "Builtins: an essential one always loads; a default one turns off by its short name "
    "(VLLITE_PLUGINS=-NAME or VLLITE_DISABLED_PLUGINS=NAME)."
)


class PluginsCommand:
    """``vllite plugins``: every loaded plugin, its distribution and entry-point group, the hooks it implements and
    what it registers (a builtin marked ``essential`` or ``default`` with its short name; a default one the
    environment turned off is listed as ``DISABLED``), then the logits-processor entry points of the
    ``vllm.logits_processors`` / ``vllite.logits_processors`` groups (distribution, entry point, class), filtered by
    ``VLLITE_PLUGINS`` / ``VLLITE_DISABLED_PLUGINS`` / ``VLLITE_DISABLE_PLUGIN_AUTOLOAD`` exactly as the engine
    filters them.

    The listing imports no component registered by class path and no logits-processor entry point (so it is quick
    and imports no torch); what it can see is broken — a plugin that fails to import, a duplicate name — is marked
    ``BROKEN``. ``--check`` imports every component and puts every logits processor through the engine's own
    interface check, marks what start-up would refuse with the error it would raise, and exits with 1 when anything
    is broken, naming each on standard error (see :mod:`vllite.plugins.commands.plugin_report`)."""

    help = "List plugins, their hooks and the components they register; --check imports and checks every one."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
        parser.add_argument(
            "--check",
            action="store_true",
            help="Import every component and check it as engine start-up does; exit with status 1 if any plugin or "
            "logits processor is broken (each is named on stderr).",
        )

    def run(self, args: argparse.Namespace) -> int:
        import json

        from vllite.plugins.commands.plugin_report import plugin_report

        rows = plugin_report(check=args.check)
        broken = [row for row in rows if row.broken]
        if args.json:
            print(json.dumps([row.as_json() for row in rows], indent=2))
        else:
            _print_plugin_rows(rows)
        disable = sorted({row.disable_name for row in broken if row.disable_name})
        hint = f" (VLLITE_DISABLED_PLUGINS={','.join(disable)} turns them off)" if disable else ""
        if args.check:
            for row in broken:
                for message in row.errors:
                    print(f"vllite: error: {message}", file=sys.stderr)
            if broken:
                print(f"vllite: error: {len(broken)} broken plugin(s){hint}", file=sys.stderr)
                return 1
            print(f"{len(rows)} plugins checked, none broken.", file=sys.stderr if args.json else sys.stdout)
        elif not args.json:
            if broken:
                print(f"{len(broken)} broken: the engine will not start while they load{hint}.")
            print(BUILTINS_NOTE)
            print("Listed without importing the components; `vllite plugins --check` imports and checks each one.")
        return 0


def _print_plugin_rows(rows: list[Any]) -> None:
    for row in rows:
        group = f"  (group {row.group})" if row.group else ""
        builtin = f"  {row.builtin}" if row.builtin else ""
        if row.builtin and row.short_name:
            builtin += f" {row.short_name!r}"
        print(f"{row.name}  [{row.distribution}]{group}{builtin}")
        if row.status == "disabled":
            print(f"    DISABLED: VLLITE_PLUGINS / VLLITE_DISABLED_PLUGINS deny {row.short_name!r}")
        elif row.entry_point is not None:
            print(f"    entry point: {row.entry_point}")
            if row.cls:
                print(f"    class: {row.cls}")
        else:
            print(f"    hooks: {', '.join(row.hooks) or '-'}")
            for kind, names in row.components.items():
                print(f"    {kind}: {', '.join(names)}")
        for message in row.errors:
            print(f"    BROKEN: {message}")


def _add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    from vllite.engine_args import EngineArgs

    model_default = "default: the model's generation_config.json, else %s"
    parser.add_argument("--max-tokens", type=int, default=None, help=model_default % "64" + ".")
    parser.add_argument("--temperature", type=float, default=None, help=model_default % "0 (greedy)" + ".")
    parser.add_argument("--top-p", type=float, default=None, help=model_default % "1.0" + ".")
    parser.add_argument("--top-k", type=int, default=None, help=model_default % "0 (off)" + ".")
    parser.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed.")
    EngineArgs.add_cli_args(parser)
    add_vllm_only_flags(parser)


def _make_llm(args: argparse.Namespace) -> Any:
    from vllite.engine.llm import LLM
    from vllite.engine_args import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    check_engine_args(engine_args)  # a mistake that needs no model fails in a second, before the engine starts
    return LLM.from_engine_args(engine_args)


# What the CLI does when neither a flag nor the model's generation config says otherwise: greedy, 64 tokens.
_CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}


def _sampling_params(args: argparse.Namespace, llm: Any) -> Any:
    """The flags given, over the model's generation-config defaults (``--generation-config``), over the CLI's."""
    from vllite.sampling_params import SamplingParams

    fields: dict[str, Any] = {**_CLI_SAMPLING_DEFAULTS, **llm.llm_engine.frontend.default_sampling_fields}
    flags = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.sampling_seed,
    }
    fields.update({name: value for name, value in flags.items() if value is not None})
    return SamplingParams(**fields)


def _report_failure(output: Any) -> int:
    """Prints ``vllite: error: ...`` to stderr for each sample of ``output`` that failed; returns how many did."""
    failed = [c for c in output.outputs if c.finish_reason == "error"]
    for completion in failed:
        message = completion.error or "unknown error"
        print(f"vllite: error: request {output.request_id} failed: {message}", file=sys.stderr)
    return len(failed)


class GenerateCommand:
    """``vllite generate PROMPT...``: complete prompts with a local model (the demo model by default)."""

    help = "Generate completions for prompts (default model: the embedded demo model)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("prompts", nargs="*", help="Prompts (read from stdin, one per line, if none given).")
        _add_generation_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        """Prints each completion as soon as it and those before it are done, in prompt order. On Ctrl-C it stops
        printing and shuts the engine down; ``KeyboardInterrupt`` goes on to the CLI (``vllite: interrupted``,
        exit code 130)."""
        prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
        if not prompts:
            raise ValueError("No prompt given: pass prompts as arguments or on standard input.")
        llm = _make_llm(args)
        failed = 0
        progress = None
        try:
            params = _sampling_params(args, llm)
            progress = _progress_bar(len(prompts)) if len(prompts) > 1 else None
            for output in _completions_in_order(llm.llm_engine, prompts, params, progress):
                _print_over_progress(output.prompt + output.outputs[0].text, progress)
                failed += _report_failure(output)
                if len(prompts) > 1:
                    _print_over_progress("-" * 40, progress)
        finally:
            if progress is not None:
                progress.close()
            llm.shutdown()
        return 1 if failed else 0


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


def _print_over_progress(text: str, progress: Any) -> None:
    """Prints (and flushes) ``text`` on standard output without tearing the progress bar on standard error."""
    if progress is None:
        print(text, flush=True)
        return
    with progress.external_write_mode(file=sys.stdout):
        print(text, flush=True)


def _completions_in_order(engine: Any, prompts: list[str], params: Any, progress: Any) -> Iterator[Any]:
    """Submits every prompt, then yields the final ``RequestOutput``s in prompt order, each as soon as it and those
    before it are done (the engine goes on with the rest meanwhile). A Ctrl-C (or any error) comes out of the
    engine's ``step()``; the caller shuts the engine down, which ends the requests still in flight."""
    from vllite.sampling_params import RequestOutputKind

    params = params.clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    request_ids = [str(i) for i in range(len(prompts))]
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, prompt, params)
    finished: dict[str, Any] = {}
    for request_id in request_ids:
        while request_id not in finished:
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        yield finished.pop(request_id)


class ChatCommand:
    """``vllite chat``: an interactive chat through the model's chat template. Ctrl-C (at the prompt or during a reply,
    which is then not printed) ends the chat: the CLI prints ``vllite: interrupted`` and exits with 130."""

    help = "Chat with a local model through its chat template (one message per line; empty line or EOF ends)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--system", default=None, help="System prompt.")
        parser.add_argument("--message", action="append", default=None, help="Send this message and exit.")
        parser.add_argument(
            "--chat-template",
            default=None,
            help="A Jinja chat template, or a file holding one, instead of the tokenizer's.",
        )
        _add_generation_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        chat_template = load_chat_template(args.chat_template)
        llm = _make_llm(args)
        sampling_params = _sampling_params(args, llm)
        messages: list[dict[str, str]] = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        scripted = list(args.message or [])
        try:
            while True:
                if scripted:
                    text = scripted.pop(0)
                elif args.message:
                    break
                else:
                    try:
                        text = input("> ")
                    except EOFError:
                        break
                    except KeyboardInterrupt:
                        print(file=sys.stderr)  # end the prompt's line before `vllite: interrupted`
                        raise
                if not text.strip():
                    break
                messages.append({"role": "user", "content": text})
                outputs = llm.chat(messages, sampling_params, use_tqdm=False, chat_template=chat_template)
                _report_failure(outputs[0])
                reply = outputs[0].outputs[0].text
                print(reply)
                messages.append({"role": "assistant", "content": reply})
        finally:
            llm.shutdown()
        return 0


@hookimpl
def vllite_register_commands(register: Any) -> None:
    register("plugins", PluginsCommand())
    register("generate", GenerateCommand())
    register("chat", ChatCommand())
