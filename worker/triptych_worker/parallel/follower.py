"""`python -m triptych_worker.parallel.follower RANK <triptych serve flags>`: one follower rank.

Started by rank 0 (`triptych_worker.parallel.ranks.start_ranks`), never by hand.
"""

from __future__ import annotations

import signal
import sys

from triptych.cli import build_parser
from triptych.config import ServeArgs
from triptych.launch import configure_logging
from triptych_worker.parallel.ranks import die_with_parent, follow


def main(argv: list[str]) -> int:
    die_with_parent()
    # A drain (SIGTERM) or Ctrl-C (SIGINT, sent to the whole process group) is rank 0's business: it ends this process.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = int(argv[0])
    args = ServeArgs.from_namespace(build_parser().parse_args(["serve", *argv[1:]]))
    configure_logging(args, f"{args.disagg_role.value} rank {rank}")
    follow(args, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
