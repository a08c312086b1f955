"""``python -m kvboost_hf.serve_ray --replicas N --routing prefix [server flags]``."""

from __future__ import annotations

import sys

from kvboost_hf.serve_ray.launch import main

if __name__ == "__main__":
    sys.exit(main())
