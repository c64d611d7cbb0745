#!/usr/bin/env python
"""The OpenAI-compatible server: ``python scripts/serve.py [--model MODEL] [flags]`` is ``moejax serve``
(moejax/server/cli.py holds the server, its flags and its processes; ``--help`` lists them)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moejax.server.cli import build_load_kwargs, build_parser, check_speculative, main, worker_argv  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main(prog="scripts/serve.py"))
