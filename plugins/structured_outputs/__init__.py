"""The builtin grammar backends, registered by ``plugin`` through ``vllite_register_structured_output_backends``.

``xgrammar`` (the default; with the strict-JSON and bounded-string grammar rewrites) and ``guidance``
(llguidance). The contract they implement is ``vllite.structured_output`` (backend interface, registry, manager,
bitmask helpers).
"""
