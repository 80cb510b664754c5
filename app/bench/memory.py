"""`python -m app.bench.memory [--config configs/gpt_fsdp.yaml] [--ranks 1,2,4] [--json F]`: what FSDP2 saves.

For each number of ranks the config trains `--steps` optimizer steps twice, with `strategy: ddp` and with its FSDP2
strategy, each a real `ddp-app fit`. A callback in every rank (`MemoryProbe`) counts the bytes this rank holds of

  parameters   every parameter's local tensor (under FSDP2 its shard, a DTensor's local part),
  gradients    every gradient's local tensor, counted right before the optimizer step,
  optimizer    every tensor of the optimizer's state (Adam's two moments and step), after a step,

and times each step (the median after the first two); on a GPU also `torch.cuda.max_memory_allocated`. FSDP2 keeps 1/N
plus padding; "÷ ddp" is FSDP2's bytes over DDP's at the same number of ranks.

The default model is the config's with `--model-args` applied (d_model 256, 4 blocks: about 3.2 M parameters), one
thread per rank; more ranks than cores make the step times relative, not what a GPU node measures.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

from app.bench.report import bench_parser, counts, shown_and_saved

STRATEGIES = ("ddp", "fsdp")
DDP = {"class_path": "lightning.pytorch.strategies.DDPStrategy"}
DEFAULT_MODEL_ARGS = ["--model.init_args.d_model=256", "--model.init_args.n_layers=4"]
WARMUP_STEPS = 2


def local_bytes(tensor: torch.Tensor) -> int:
    """The bytes this rank stores for `tensor` (a DTensor's local shard, else the tensor itself)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class MemoryProbe(Callback):
    """Counts this rank's parameter, gradient and optimizer-state bytes and times each step.

    Writes `out/rank<r>.json` at the end of the fit (`python -m app.bench.memory` adds it to each run)."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.figures: dict[str, Any] = {}
        self.step_ms: list[float] = []
        self._started = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._started = time.perf_counter()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        grads = [parameter.grad for parameter in pl_module.parameters() if parameter.grad is not None]
        self.figures["gradient_bytes"] = sum(local_bytes(grad) for grad in grads)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.step_ms.append((time.perf_counter() - self._started) * 1e3)
        self.figures["parameter_bytes"] = sum(local_bytes(parameter) for parameter in pl_module.parameters())
        self.figures["parameters"] = sum(
            parameter.numel() for parameter in pl_module.parameters()
        )  # the whole model's count (a DTensor's numel is its global size)
        self.figures["optimizer_bytes"] = sum(
            local_bytes(value)
            for optimizer in trainer.optimizers
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        steady = self.step_ms[WARMUP_STEPS:] or self.step_ms
        record = {**self.figures, "step_ms": statistics.median(steady), "steps": len(self.step_ms)}
        if trainer.strategy.root_device.type == "cuda":
            record["max_memory_allocated"] = torch.cuda.max_memory_allocated(trainer.strategy.root_device)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def variant_config(config: dict[str, Any], strategy: str, ranks: int, path: Path) -> Path:
    """The config with this strategy and number of ranks (the FSDP2 strategy is the config's own)."""
    variant = json.loads(json.dumps(config))
    trainer = variant.setdefault("trainer", {})
    if strategy == "ddp":
        trainer["strategy"] = DDP
    trainer["devices"] = ranks
    trainer["num_nodes"] = 1
    path.write_text(yaml.safe_dump(variant))
    return path


def run_one(config: Path, strategy: str, ranks: int, steps: int, extra: list[str], scratch: Path) -> dict[str, Any]:
    """One `ddp-app fit` of `steps` steps; the per-rank figures its MemoryProbe wrote."""
    out = scratch / f"{strategy}-{ranks}"
    probe = {"class_path": "app.bench.memory.MemoryProbe", "init_args": {"out": str(out / "probe")}}
    command = [
        sys.executable,
        "-m",
        "app",
        "fit",
        "--config",
        str(config),
        *extra,
        f"--trainer.max_steps={steps}",
        "--trainer.max_epochs=-1",
        f"--trainer.default_root_dir={out / 'run'}",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=" + json.dumps(probe),
    ]
    env = {**os.environ, "DDP_APP_ALLOW_OVERSUBSCRIBE": "1"}
    log = scratch / f"{strategy}-{ranks}.log"
    with log.open("w") as handle:
        result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=1800, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{strategy} on {ranks} ranks failed (exit {result.returncode}); see {log}:\n"
                           + log.read_text()[-3000:])  # fmt: skip
    return {"ranks": [json.loads((out / "probe" / f"rank{rank}.json").read_text()) for rank in range(ranks)]}


def summarize(runs: dict[str, Any], batch_tokens: int) -> dict[str, Any]:
    """Per (strategy, ranks): the largest rank's bytes of each kind, their sum, the step time, tokens/s."""
    summary: dict[str, Any] = {}
    for key, run in runs.items():
        ranks = run["ranks"]
        largest = {
            kind: max(rank[kind] for rank in ranks) for kind in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")
        }
        step_ms = max(rank["step_ms"] for rank in ranks)  # the slowest rank sets the pace
        summary[key] = {
            **largest,
            "total_bytes": sum(largest.values()),
            "parameters": ranks[0]["parameters"],
            "step_ms": step_ms,
            "tokens_per_s": batch_tokens * len(ranks) / step_ms * 1e3,
            **(
                {"max_memory_allocated": max(r["max_memory_allocated"] for r in ranks)}
                if "max_memory_allocated" in ranks[0]
                else {}
            ),
        }
    for key, figures in summary.items():
        strategy, ranks = key.split("-")
        if strategy == "fsdp" and f"ddp-{ranks}" in summary:
            figures["over_ddp"] = figures["total_bytes"] / summary[f"ddp-{ranks}"]["total_bytes"]
            figures["step_over_ddp"] = figures["step_ms"] / summary[f"ddp-{ranks}"]["step_ms"]
    return summary


def print_table(results: dict[str, Any]) -> None:
    print(f"{results['parameters'] / 1e6:.2f} M parameters, {results['batch_tokens']} tokens per rank and step")
    print(f"{'strategy':<9}{'ranks':>6}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}{'total MB':>10}"
          f"{'÷ ddp':>7}{'step ms':>9}{'÷ ddp':>7}")  # fmt: skip
    for key, figures in results["runs"].items():
        strategy, ranks = key.split("-")
        over = f"{figures['over_ddp']:.3f}" if "over_ddp" in figures else "1"
        step_over = f"{figures['step_over_ddp']:.2f}" if "step_over_ddp" in figures else "1"
        megabytes = [figures[kind] / 1e6 for kind in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")]
        print(
            f"{strategy:<9}{ranks:>6}{megabytes[0]:>11.2f}{megabytes[1]:>10.2f}{megabytes[2]:>10.2f}"
            f"{figures['total_bytes'] / 1e6:>10.2f}{over:>7}{figures['step_ms']:>9.1f}{step_over:>7}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("python -m app.bench.memory", __doc__, "configs/gpt_fsdp.yaml")
    parser.add_argument("--ranks", type=lambda text: counts(text, 1, "--ranks"), default=[1, 2, 4], help="e.g. 1,2,4")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--model-args",
        nargs="*",
        default=DEFAULT_MODEL_ARGS,
        help="overrides of the config's model (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    data = config["data"]["init_args"]
    batch_tokens = int(data["batch_size"]) * int(data.get("context", 1))
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as scratch:
        for ranks in args.ranks:
            for strategy in STRATEGIES:
                path = variant_config(config, strategy, ranks, Path(scratch) / f"{strategy}-{ranks}.yaml")
                print(f"bench.memory: {strategy} on {ranks} ranks ...", flush=True)
                runs[f"{strategy}-{ranks}"] = run_one(path, strategy, ranks, args.steps, args.model_args, Path(scratch))
    summary = summarize(runs, batch_tokens)
    results = {
        "command": " ".join(["python -m app.bench.memory", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu_count": os.cpu_count(), "cuda": torch.cuda.is_available()},
        "config": str(args.config),
        "model_args": args.model_args,
        "steps": args.steps,
        "batch_tokens": batch_tokens,
        "parameters": next(iter(summary.values()))["parameters"],
        "runs": summary,
        "per_rank": runs,
    }
    return shown_and_saved(results, args.json, print_table)


if __name__ == "__main__":
    main()
