"""Planning: which strategy x schedule x knobs to train, and whether it fits (torch-free).

* :mod:`moesaic.planning.planner` — ``plan_runs``: every runnable combination simulated
  (:mod:`moesaic.sim`) and ranked, with the reason for the pick;
* :mod:`moesaic.planning.plan_memory` — each ranked combination's predicted per-rank peak
  (:mod:`moesaic.sim.memory`), ``--memory-per-rank`` and the FSDP2 sharding that makes it fit;
* :mod:`moesaic.planning.sharding` — ``check_sharding``: what runs sharded (the trainer's
  config reads it too);
* :mod:`moesaic.planning.loads` — which expert loads a plan prices;
* :mod:`moesaic.planning.stepmodel` — ``predict_step`` / ``plan_step``: HybridEP's whole
  training step per choice of domains, over the stream cost model
  (:mod:`moesaic.sim.hybrid_costmodel`).

Used by ``moesaic plan`` (:mod:`moesaic.simtools.plan_cli`), ``moesaic train --plan auto`` (a call
on rank 0, :mod:`moesaic.train.plan_auto`) and ``--domains auto``. Imports :mod:`moesaic.sim`,
never ``measure``, ``train`` or ``simtools`` (``tests/test_import_graph.py``).
"""
