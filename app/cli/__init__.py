"""The `ddp-app` command: `entry.py` checks the command line once and starts and supervises the ranks,
`parser.py` is the LightningCLI each rank parses with, `resume_check.py` is `ddp-app resume-check`,
`diagnose.py` `ddp-app diagnose`.
What a run is made of, in the order it is built, is app/run/build.py.

The parser's public names are importable from here, so that `class_path: app.cli.SafeCheckpointIO`
(the Trainer defaults, and every saved config.yaml) keeps naming the same class.
"""

from app.checkpoints.plugin import SafeCheckpointIO
from app.cli.parser import DDPAppCLI, ParsedRun, parse_config
from app.run.build import NoProfiler

__all__ = ["DDPAppCLI", "NoProfiler", "ParsedRun", "SafeCheckpointIO", "parse_config"]
