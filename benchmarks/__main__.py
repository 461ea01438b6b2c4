"""``python -m benchmarks``: parity check, then the attention sweep, module and GPT benchmarks."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
