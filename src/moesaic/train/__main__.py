"""Per-worker entry under an external launcher: ``torchrun [...] -m moesaic.train [flags]``.

Takes the same flags as ``moesaic train`` (``--nproc`` and ``--max-restarts`` are torchrun's
business here and ignored) and runs this process's rank of the job. Rank 0 holds the run
directory's lock; each rank prints its own error as one line (its traceback goes to
``RUN_DIR/logs/rank_<R>.log``) and exits 1, or 130 on Ctrl-C.
"""

import argparse
import sys

from moesaic.train.flags import add_train_arguments, config_from_args
from moesaic.train.worker import worker_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moesaic.train",
        description="One worker of a moesaic training job (start it with torchrun).",
    )
    add_train_arguments(parser)
    try:
        cfg = config_from_args(parser.parse_args(argv))
    except (ValueError, FileNotFoundError) as exc:
        print(f"moesaic train: error: {exc}", file=sys.stderr)
        return 2
    if cfg.emulate is not None:
        print(
            f"moesaic train: error: --emulate {cfg.emulate} starts the workers itself, inside "
            "the emulated cluster: run `moesaic train --emulate ...`, not torchrun",
            file=sys.stderr,
        )
        return 2
    worker_main(cfg, launched=False)
    return 0


if __name__ == "__main__":
    from moesaic.train.launched import exit_now

    exit_now(main())  # without the interpreter's teardown (launched.exit_now says why)
