"""OpenAI's Realtime API (``/v1/realtime``, text over a WebSocket): ``protocol`` (the events), ``turns`` and
``sampling`` (a turn's input and sampling), ``session`` (one engine session per connection, and the router).
"""

from vllite import deprecated_aliases

_MOVED = dict.fromkeys(("realtime_router", "RealtimeConnection"), f"{__name__}.session")


def __getattr__(name: str) -> object:
    # The module this package replaced (``realtime.py``) is now ``realtime.session``: its names keep working one
    # release.
    return deprecated_aliases.moved_attribute(__name__, name, _MOVED)
