"""Measuring a machine into a simulator profile (:class:`moesaic.sim.profile.Profile`): link
shares and call floors on an emulated cluster (``calibrate``), the model's operations
(``opmeasure``), GPU GEMM efficiency (``gpucal``), taskflow handler CPU (``cpucal``), the
communication's CPU (``cpuload``), the ranks' desynchronisation (``syncwait``), a quick
matmul/op-overhead profile (``machine``) and re-timing a profile (``retime``). Imports
:mod:`moesaic.sim` (the profile format), which never imports this package.
"""
