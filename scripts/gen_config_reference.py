"""Write docs/configuration.md from the code (lmiserve/config/reference.py); `--check` only compares.

    python scripts/gen_config_reference.py           # regenerate the page
    python scripts/gen_config_reference.py --check   # exit 1 if the page is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lmiserve, installed or not

from lmiserve.config.reference import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
