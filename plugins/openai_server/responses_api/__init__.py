"""OpenAI's Responses API (``/v1/responses``): ``protocol``, ``input`` (items to chat messages), ``stream`` (the
event stream), ``store`` (stored responses for ``previous_response_id``), ``routes`` (create, retrieve, delete,
cancel).
"""

from vllite import deprecated_aliases

_MOVED = dict.fromkeys(
    ("add_responses_routes", "create_response", "cancel_response", "start_response"), f"{__name__}.routes"
)


def __getattr__(name: str) -> object:
    # The module this package replaced (``responses_api.py``) is now ``responses_api.routes``: its names keep working
    # one release.
    return deprecated_aliases.moved_attribute(__name__, name, _MOVED)
