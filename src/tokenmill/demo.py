"""`python -m tokenmill.demo ["question"]`: the bundled model answers one question.

No server, no flags: proves the install works (weights found, tokenizer and
chat template read, engine runs) in one command.
"""
from __future__ import annotations

import sys

DEFAULT_QUESTION = "What is the capital of France? Answer in one sentence."


def main(argv: list[str] | None = None) -> int:
    from .entrypoints.cli.generate_cli import generate

    argv = sys.argv[1:] if argv is None else argv
    question = " ".join(argv) or DEFAULT_QUESTION
    print(f"> {question}")
    generate(question, max_tokens=96, stats=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
