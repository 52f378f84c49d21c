"""``python -m vlm_server.options --markdown``: print docs/configuration.md."""

from __future__ import annotations

import argparse
import sys

from vlm_server.options.markdown import render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm_server.options", description=__doc__)
    parser.add_argument(
        "--markdown", action="store_true", required=True, help="the option table as Markdown"
    )
    parser.parse_args(argv)
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
