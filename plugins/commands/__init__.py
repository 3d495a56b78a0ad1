"""The builtin ``vllite`` subcommands ``plugins``, ``generate`` and ``chat``, contributed through
``vllite_register_commands`` as a third party's command would be (``serve`` and ``bench`` come from their plugins).
"""
