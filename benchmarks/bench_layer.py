"""Dropless vs padded dispatch (and transformers' Mixtral block) at EP 1, 2, 4 on CPU.

Same as ``moesaic bench layer``; arguments are passed through, e.g.
``python benchmarks/bench_layer.py --tokens 2048 --ep 1,2``. Results go to
``benchmarks/results/bench_layer_cpu.json`` unless ``--out`` says otherwise.
"""

import sys

from moesaic.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "layer", *sys.argv[1:]]))
