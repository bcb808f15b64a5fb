"""Planning: what a choice of expert domains costs and which to take (HybridEP), and what a
plan holds in memory per rank.

* :mod:`moesaic.sim.hybrid_costmodel` — the paper's stream-based cost model (Eqs. 1-12),
  ``optimal_p`` / ``search_p``, multilevel ``evaluate_domains`` / ``plan_domains`` (torch-free,
  except ``measure_gemm_flops``);
* :mod:`moesaic.planning.stepmodel` — ``predict_step`` / ``plan_step``: a whole training step
  (forward, backward, gradient reduce, prefetched gathers) per candidate.
* :mod:`moesaic.sim.memory` — ``predict_memory``: one rank's bytes of parameters,
  gradients, AdamW state and a step's peak for a plan (EP, FSDP2's ``dp_shard``, HybridEP's
  domains, batch), used by ``moesaic simulate`` / ``plan`` (``--memory-per-rank``).

Used by ``moesaic train --domains auto``, ``moesaic plan`` and the simulator; imports only the
config, the cluster description, the placement's topology and compression size rules (torch-free
at import).
"""

from moesaic.sim.hybrid_costmodel import (
    DomainPlan,
    StreamInputs,
    optimal_p,
    plan_domains,
    search_p,
    stream_inputs,
)

__all__ = ["DomainPlan", "StreamInputs", "optimal_p", "plan_domains", "search_p", "stream_inputs"]
