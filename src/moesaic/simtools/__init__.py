"""The simulator's command-line tools: ``moesaic simulate`` (``simulate_cli``, ``compare``),
``moesaic calibrate`` (``calibrate_cli``) and ``moesaic plan`` (``plan_cli``), with their option
files (``cli_files``). Above everything they use (:mod:`moesaic.sim`, :mod:`moesaic.measure`,
:mod:`moesaic.planning`, :mod:`moesaic.train`); nothing in the package imports them but
``moesaic.cli``.
"""
