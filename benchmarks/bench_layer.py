"""Dropless vs padded dispatch (and transformers' Mixtral block) at EP 1, 2, 4 on CPU.

Same as ``moesaic bench layer``; arguments are passed through, e.g.
``python benchmarks/bench_layer.py --tokens 2048 --ep 1,2 --out /tmp/bench.json``. The default
run (no size options) replaces the committed ``benchmarks/results/bench_layer_cpu.json``; any
other run must name its own ``--out`` (a file, or a directory to write into).
"""

import sys

from moesaic.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "layer", *sys.argv[1:]]))
