"""Beam search as vLLM does it: a frontend loop over the engine, not a mode of the model runner.

Each step submits every live beam as a one-token request asking for its top logprobs (prefix caching makes the
re-submitted prefix cheap) and keeps the best continuations. ``LLM.beam_search`` drives the loop with blocking
calls (:mod:`vllite.plugins.beam_search.offline`) and the server (``use_beam_search``) with ``await``; both share
:class:`BeamSearch`, which holds the algorithm and never talks to an engine. Its results are the kernel's
``vllite.outputs.BeamSearchOutput`` and ``BeamSearchSequence`` (the return type of ``LLM.beam_search``).

The selection is Hugging Face's ``generate(num_beams=..., do_sample=False)`` (transformers 5), step for step:

- the candidates of a step are the best ``max(2, 1 + #eos) * beam_width`` continuations of all live beams by
  cumulative logprob (each beam asks the engine for enough top logprobs to hold them);
- a candidate that ends with an EOS token (unless ``ignore_eos``) or reaches ``max_tokens`` is finished; only
  finished candidates among the first ``beam_width`` are kept, scored ``cum_logprob / generated_len **
  length_penalty`` (the EOS token counted), the best ``beam_width`` finished ones so far;
- the best ``beam_width`` unfinished candidates are the next step's beams;
- the search ends when no beam is left, or by ``early_stopping``: ``True`` as soon as ``beam_width`` sequences
  finished; ``False`` (the default) once the best live beam, scored at its current length, cannot beat the worst
  kept finished one; ``"never"`` only when no live beam can beat it at any length up to ``max_tokens``.

vLLM (whose current frontend loop has no early stopping and always runs ``max_tokens`` steps) scores by the length
of the whole sequence, prompt included, and without the EOS token, as older transformers did; the ranking here is
transformers' current one, so the two agree exactly when ``length_penalty`` is 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllite.outputs import BeamSearchOutput, BeamSearchSequence, Logprob
from vllite.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class _Instance:
    """The search state of one prompt."""

    prompt_len: int
    max_new: int
    beams: list[BeamSearchSequence]
    finished: list[tuple[float, BeamSearchSequence]] = field(default_factory=list)
    done: bool = False


class BeamSearch:
    """The search over a batch of tokenized prompts; the caller runs the engine between :meth:`live_beams` and
    :meth:`advance` until :attr:`done`, then reads :meth:`outputs`.

    ``eos_token_ids``: the tokens that finish a sequence (the model's EOS and its generation config's);
    ``max_model_len`` caps each prompt's ``max_tokens``. Raises ``ValueError`` for a prompt that leaves no room to
    generate.
    """

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        params: BeamSearchParams,
        eos_token_ids: Iterable[int],
        *,
        max_model_len: int | None = None,
        lora_request: Any = None,
    ) -> None:
        self.params = params
        self.eos = set() if params.ignore_eos else {int(t) for t in eos_token_ids}
        width = params.beam_width
        # Hugging Face keeps max(2, 1 + #eos) * width candidates; a beam can hold at most width + #eos of the ones
        # that matter, so this many top logprobs per beam always covers them.
        self.num_candidates = max(2, 1 + len(self.eos)) * width
        self.num_logprobs = max(2 * width, width + len(self.eos))
        self.instances: list[_Instance] = []
        for prompt in prompts:
            room = params.max_tokens if max_model_len is None else min(params.max_tokens, max_model_len - len(prompt))
            if room < 1:
                raise ValueError(
                    f"The prompt is {len(prompt)} tokens long: it leaves no room to generate within the maximum model "
                    f"length of {max_model_len}."
                )
            beam = BeamSearchSequence(tokens=list(prompt), logprobs=[], lora_request=lora_request)
            self.instances.append(_Instance(prompt_len=len(prompt), max_new=room, beams=[beam]))

    def step_params(self) -> SamplingParams:
        """The engine request of one beam: one token, with the top logprobs the candidates need."""
        return SamplingParams(
            max_tokens=1, logprobs=self.num_logprobs, temperature=self.params.temperature, ignore_eos=True
        )

    @property
    def done(self) -> bool:
        return all(instance.done for instance in self.instances)

    def live_beams(self) -> list[BeamSearchSequence]:
        """The beams to expand this step, prompt by prompt (the order :meth:`advance` expects its results in)."""
        return [beam for instance in self.instances if not instance.done for beam in instance.beams]

    def advance(self, step_logprobs: Sequence[dict[int, Logprob]]) -> None:
        """Takes each live beam's top logprobs at its next position (in :meth:`live_beams` order)."""
        results = iter(step_logprobs)
        for instance in self.instances:
            if not instance.done:
                self._advance_instance(instance, [next(results) for _ in instance.beams])

    def _advance_instance(self, instance: _Instance, step_logprobs: list[dict[int, Logprob]]) -> None:
        params = self.params
        width = params.beam_width
        candidates = []
        for order, (beam, position) in enumerate(zip(instance.beams, step_logprobs)):
            for token_id, entry in position.items():
                if entry.rank is not None and entry.rank <= self.num_logprobs:
                    candidates.append((beam.cum_logprob + entry.logprob, order, entry.rank, beam, token_id, position))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        generated = len(instance.beams[0].tokens) - instance.prompt_len + 1
        full = params.early_stopping is True and len(instance.finished) >= width
        running: list[BeamSearchSequence] = []
        for rank, (score, _, _, beam, token_id, position) in enumerate(candidates[: self.num_candidates]):
            stop = token_id in self.eos
            new = BeamSearchSequence(
                tokens=[*beam.tokens, token_id],
                logprobs=[*beam.logprobs, position],
                lora_request=beam.lora_request,
                cum_logprob=score,
            )
            if stop or generated >= instance.max_new:
                if rank < width and not full:
                    new.finish_reason = "stop" if stop else "length"
                    new.stop_reason = token_id if stop else None
                    instance.finished.append((score / generated**params.length_penalty, new))
            elif len(running) < width:
                running.append(new)
        instance.finished.sort(key=lambda item: -item[0])
        del instance.finished[width:]
        instance.beams = running
        instance.done = not running or self._cannot_improve(instance, generated)

    def _cannot_improve(self, instance: _Instance, generated: int) -> bool:
        params = self.params
        if len(instance.finished) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        length = instance.max_new if params.early_stopping == "never" and params.length_penalty > 0 else generated
        best_possible = instance.beams[0].cum_logprob / length**params.length_penalty
        return best_possible <= instance.finished[-1][0]

    def outputs(self, tokenizer: Any = None, *, whole_text: bool = True) -> list[BeamSearchOutput]:
        """The best sequences of each prompt, best first. ``text`` is the whole sequence decoded (``whole_text``,
        as ``LLM.beam_search`` returns it in vLLM), or only the generated tokens, without a final EOS unless
        ``include_stop_str_in_output`` (as vLLM's server answers)."""
        results = []
        for instance in self.instances:
            ranked = list(instance.finished)
            for beam in instance.beams:  # a search cut short keeps its live beams as length-finished candidates
                if len(ranked) >= self.params.beam_width:
                    break
                beam.finish_reason = "length"
                length = max(len(beam.tokens) - instance.prompt_len, 1)
                ranked.append((beam.cum_logprob / length**self.params.length_penalty, beam))
            ranked.sort(key=lambda item: -item[0])
            best = [sequence for _, sequence in ranked[: self.params.beam_width]]
            for sequence in best:
                sequence.text = self._text(sequence, instance.prompt_len, tokenizer, whole_text)
            results.append(BeamSearchOutput(sequences=best))
        return results

    def _text(self, sequence: BeamSearchSequence, prompt_len: int, tokenizer: Any, whole_text: bool) -> str | None:
        if tokenizer is None:
            return None
        if whole_text:
            return tokenizer.decode(sequence.tokens)
        generated = sequence.tokens[prompt_len:]
        if sequence.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            generated = generated[:-1]
        return tokenizer.decode(generated, skip_special_tokens=True)


def eos_token_ids(input_processor: Any) -> list[int]:
    """The tokens that end a sequence for a frontend's model: its primary EOS and its generation config's."""
    ids: list[int] = []
    primary = getattr(input_processor, "eos_token_id", None)
    if primary is not None:
        ids.append(int(primary))
    extra = (getattr(input_processor, "generation_config_fields", None) or {}).get("eos_token_id")
    for token_id in [extra] if isinstance(extra, int) else list(extra or ()):
        if int(token_id) not in ids:
            ids.append(int(token_id))
    return ids
