"""The ``moejax`` command (pyproject.toml's console script; ``python -m moejax`` is the same):

  moejax serve MODEL [flags]     the OpenAI-compatible server (moejax/server/cli.py; vLLM's `vllm serve`)

``moejax serve --help`` lists the flags: the engine's settings (moejax/engine_args.py) and the server's.
"""

from __future__ import annotations

import sys

from moejax.server import cli as serve_cli

COMMANDS = {"serve": (serve_cli.main, "the OpenAI-compatible HTTP server")}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        usage = "usage: moejax {" + ",".join(COMMANDS) + "} ...\n\n" + "\n".join(
            f"  {name:8s} {what}" for name, (_, what) in COMMANDS.items())
        if argv and argv[0] in ("-h", "--help"):
            print(usage)
            return 0
        print(usage + (f"\n\nmoejax: unknown command {argv[0]!r}" if argv else ""), file=sys.stderr)
        return 2
    run, _ = COMMANDS[argv[0]]
    return run(argv[1:], prog=f"moejax {argv[0]}")
