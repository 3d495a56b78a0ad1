"""Benchmarks shipped as ``vllite bench`` commands: ``vllite bench agent`` and ``vllite bench serve``.

``vllite bench agent`` replays agent traces (``traces``) through several schedulers on the simulated executor
(``sim_executor``) or a live server (``agent_http``), one session per agent program (``agent_sessions``), and
reports the job completion times (``agent_bench``, ``agent_report``). ``vllite bench serve`` measures an OpenAI
server as vLLM's ``bench serve`` does (``serve_config``: the flags, standard library only; ``serve``,
``serve_client``, ``serve_requests``, ``serve_metrics``: the run). ``plugin`` registers the commands and the
``sim`` executor. Layering: imports the kernel and the policies it compares by registered name; no other plugin.
"""
