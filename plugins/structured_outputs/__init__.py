"""The builtin grammar backends, registered by ``plugin`` through ``vllite_register_structured_output_backends``,
and the engine core's structured-output manager (``manager``: grammar compilation, the per-step bitmask).

``xgrammar`` (the default; with the strict-JSON and bounded-string grammar rewrites) and ``guidance``
(llguidance). The contract they implement is ``vllite.structured_output`` (backend interface, registry, manager
interface, bitmask helpers).
"""
