"""``python -m syncer``: one syncer, with the same flags and ``DDILOCO_*``
variables as ``ddiloco syncer`` (what the library's ``local_syncer`` starts)."""

from __future__ import annotations

import argparse
import logging
import sys

from broker.cli_config import add_dataclass_args, dataclass_from_args
from broker.errors import DdilocoError
from syncer.config import SyncerConfig
from syncer.service import run_syncer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m syncer", description=__doc__)
    try:
        add_dataclass_args(parser, SyncerConfig)
        cfg = dataclass_from_args(SyncerConfig, parser.parse_args(argv))
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        run_syncer(cfg)
    except (DdilocoError, OSError) as e:
        print(f"syncer: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
