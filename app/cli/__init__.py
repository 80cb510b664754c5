"""The `ddp-app` command: `entry.py` checks the command line and supervises the ranks, `parser.py` is each rank's
LightningCLI, `resume_check.py` and `diagnose.py` the subcommands. How a run is built: app/run/build.py.

The parser's public names are importable from here, so `class_path: app.cli.SafeCheckpointIO` (saved configs) keeps
working."""

from app.checkpoints.plugin import SafeCheckpointIO
from app.cli.parser import DDPAppCLI, ParsedRun, parse_config
from app.run.build import NoProfiler

__all__ = ["DDPAppCLI", "NoProfiler", "ParsedRun", "SafeCheckpointIO", "parse_config"]
