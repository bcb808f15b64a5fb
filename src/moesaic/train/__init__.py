"""``moesaic train``: expert-parallel training of an MoE GPT under torch's elastic launcher.

Modules: ``config`` (TrainConfig, flags and TOML), ``data`` (corpus, packing, per-rank
sharding), ``parallel`` (EP x DP process groups and gradient rules), ``checkpoint`` (DCP,
atomic, EP-resharding), ``loop`` (the per-worker training loop), ``launch`` (validation and
``elastic_launch``), ``generate`` (sampling from a checkpoint), ``cli`` (the subcommands).
"""
