"""Anthropic's Messages API (``/v1/messages``): ``protocol`` (the request and response shapes), ``messages``
(to and from the engine's chat request), ``stream`` (Anthropic's event stream), ``routes`` (the router).
"""
