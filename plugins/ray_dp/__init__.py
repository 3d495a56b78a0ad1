"""The Ray backend of data parallel (``--data-parallel-backend ray``): each engine core a Ray actor.

``plugin`` registers the engine clients ``dp_ray`` / ``async_dp_ray`` when Ray is installed (imported lazily);
``client`` places the actors with a placement group and reaches them over ZMQ (TCP, CURVE) at addresses fixed
before they start; ``actor`` is the actor itself (an engine-core process without the handshake).
"""
