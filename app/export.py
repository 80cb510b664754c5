"""`python -m app.export --ckpt runs/.../last.ckpt --out model.pt`: the bare network's weights.

The output is a plain `state_dict` of the `nn.Module` in `app.models.nets` (no Lightning, no
pickled classes): `net.load_state_dict(torch.load("model.pt", weights_only=True))`.
"""

from __future__ import annotations

import argparse
import sys

from app.checkpoints import CheckpointError, export_net, safe_load


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.export", description=__doc__)
    parser.add_argument("--ckpt", required=True, help="a Lightning checkpoint (.ckpt)")
    parser.add_argument("--out", required=True, help="where to write the state_dict (.pt)")
    args = parser.parse_args(argv)
    try:
        state = export_net(args.ckpt, args.out)
        hyper_parameters = safe_load(args.ckpt).get("hyper_parameters", {})
    except CheckpointError as error:
        print(f"app.export: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    tensors = sum(value.numel() for value in state.values())
    print(f"wrote {args.out}: {len(state)} tensors, {tensors} numbers; model arguments {dict(hyper_parameters)}")


if __name__ == "__main__":
    main()
