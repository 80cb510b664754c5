"""`python -m app.reference --config configs/digits.yaml [--world-size 2] [--epochs 3] [--out DIR]`."""

from __future__ import annotations

import argparse

from app.reference.model_parallel import run_model_parallel
from app.reference.train import MakeHooks, run


def main(argv: list[str] | None = None, make_hooks: MakeHooks | None = None) -> None:
    """`make_hooks`: instrumentation for every rank (see `app.bench.reference`); None for a plain run."""
    parser = argparse.ArgumentParser(prog="python -m app.reference", description=__doc__)
    parser.add_argument("--config", required=True, help="the same YAML that ddp-app takes")
    parser.add_argument("--world-size", type=int, default=None, help="mp.spawn only (default: trainer.devices)")
    parser.add_argument("--epochs", type=int, default=None, help="default: trainer.max_epochs")
    parser.add_argument("--out", default="runs/reference", help="snapshot.pt and final.pt go here")
    parser.add_argument("--save-every", type=int, default=1, help="rank-0 snapshot every N epochs (0: never)")
    parser.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    parser.add_argument(
        "--model-parallel",
        action="store_true",
        help="train the tutorial's ToyMpModel: two halves on two devices per process, DDP without device_ids",
    )
    args = parser.parse_args(argv)
    if args.model_parallel:
        launcher = run_model_parallel(args.config, args.out, args.world_size, args.epochs, args.timeout)
    else:
        launcher = run(args.config, args.out, args.world_size, args.epochs, args.save_every, args.timeout, make_hooks)
    print(f"reference training finished (launcher: {launcher}); weights in {args.out}/final.pt")


if __name__ == "__main__":
    main()
