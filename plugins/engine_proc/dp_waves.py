"""The client's side of lockstep data parallel (``dp_lockstep``): which wave is current and whether it runs.

The client is its own coordinator (vLLM runs a separate ``DPCoordinator`` process; one client needs none):

* ``stamp`` marks each request with the current wave; the first request while the engines idle starts a wave,
  and the client then sends ``START_DP_WAVE`` to every other engine (the one given the request starts on it);
* ``wave_complete`` from rank 0 ends the wave (a stale one — older than the current wave — is ignored);
* ``start_wave`` from an engine (it found work while idle: a request that crossed a wave's end, or a resume)
  marks the wave running and asks the client to wake the other engines; one for a wave that has already ended
  (overtaken by that wave's ``wave_complete``) is ignored.

See ``dp_core_proc`` for the engines' side.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from vllite.protocol import EngineCoreOutputs, EngineCoreRequest


@dataclass
class WaveCoordinator:
    """Wave state shared by the frontend (``stamp``) and the engines' output threads (``on_outputs``)."""

    wave: int = 0
    engines_running: bool = False
    waves_completed: int = 0
    waves_started_by_engines: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stamp(self, request: EngineCoreRequest) -> bool:
        """Stamps ``request`` with the current wave; True when this request starts a wave (the other engines
        must be sent ``START_DP_WAVE``)."""
        with self.lock:
            request.current_wave = self.wave
            starts = not self.engines_running
            self.engines_running = True
            return starts

    def on_outputs(self, outputs: EngineCoreOutputs) -> int | None:
        """Takes an engine's wave notices; returns the wave to broadcast when the engine started one."""
        with self.lock:
            if outputs.wave_complete is not None and outputs.wave_complete >= self.wave:
                self.wave = outputs.wave_complete + 1
                self.engines_running = False
                self.waves_completed += 1
            # A start_wave older than the current wave is stale: that wave already ended on every engine (its
            # notice was overtaken by rank 0's wave_complete, which comes on another socket).
            if outputs.start_wave is not None and outputs.start_wave >= self.wave:
                self.wave = outputs.start_wave
                self.engines_running = True
                self.waves_started_by_engines += 1
                return outputs.start_wave
        return None
