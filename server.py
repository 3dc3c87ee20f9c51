"""OpenAI-compatible HTTP server for jaxinfer; the same as ``jaxinfer serve``.

    python server.py --model smollm2-135m-instruct --host 127.0.0.1 --port 8000 [--api-key KEY]

See docs/SERVER.md for the endpoints, flags, metrics and operations.
"""

import argparse
import sys

from jaxinfer.server import add_serve_arguments, run_server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="jaxinfer OpenAI-compatible server")
    add_serve_arguments(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
