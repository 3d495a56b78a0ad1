"""Operational routes: ``load`` (``/load`` and its middleware), ``info`` (``/server_info``), ``kv_events``
(``/kv_event_sources``), ``sagemaker`` (``/ping``, ``/invocations``) and ``routes`` (the development routes,
``/sleep``, ``/pause``, ``/collective_rpc``, ...).
"""
