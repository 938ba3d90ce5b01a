"""``python -m services.admission``: the webhook and the pod bridge (what the chart runs)."""

from __future__ import annotations

import argparse
import sys

from services.admission.app import add_arguments, run
from services.runtime.errors import SettingsError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.admission", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except SettingsError as exc:
        print(f"tandem admission: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
