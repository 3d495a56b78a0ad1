"""The in-process engine client (``inprocess``): the engine core runs in the caller's thread, one step per
``get_output()``. An essential builtin: ``make_client`` falls back to it when multiprocessing is off."""
