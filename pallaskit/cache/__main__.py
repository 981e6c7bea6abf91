"""``python -m pallaskit.cache stats|clear``: look at or empty the graph cache.

The directory is the one pallaskit would use (``cache_dir`` from
``PALLASKIT_CACHE_DIR`` or the default), or ``--dir``."""
from __future__ import annotations

import argparse
import sys

from pallaskit import cache
from pallaskit.config import config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallaskit.cache", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("stats", "clear"))
    parser.add_argument("--dir", help="cache directory (default: the configured one)")
    args = parser.parse_args(argv)
    if args.dir:
        config.update(cache_dir=args.dir)
    try:
        if args.command == "clear":
            n = cache.clear()
            print(f"removed {n} entries from {cache.graphs_dir()}")
            return 0
        s = cache.stats()
    except OSError as e:  # not a directory, no permission: one line, not a traceback
        print(f"pallaskit cache: cannot {args.command} {cache.cache_dir()}: {e}", file=sys.stderr)
        return 1
    print(f"directory:        {s['dir']}")
    print(f"entries:          {s['entries']} ({s['with_executable']} with executable, "
          f"{s['source_only']} source only, {s['bad']} unreadable)")
    print(f"size:             {s['bytes'] / 2**20:.2f} MiB of {s['max_bytes'] / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
