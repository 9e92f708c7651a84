"""The chat prompts the real group gives SmolLM2-135M-Instruct (tests/test_real*.py): a system prompt, and four rows of
chat messages, one with its own system message."""

import json
from pathlib import Path

SYSTEM = "Answer in one short sentence."
ROWS = [
    {"messages": [{"role": "user", "content": "What is 12 + 30?"}], "answer": "42"},
    {"messages": [{"role": "user", "content": "Name a primary color."}], "answer": "red"},
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "answer": "Paris"},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello in French."}], "answer": "Bonjour"},
]


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path
