"""Prompts shared by the tests: short ones and one long one built from real prose."""

SHORT = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "Photosynthesis is the process by which",
]

_PARAGRAPH = (
    "The history of computing is a story of ideas that arrived long before the machines "
    "that could run them. Mathematicians described algorithms for arithmetic, sorting and "
    "search centuries ago, and engineers later built mechanical calculators that could add "
    "and multiply with gears. In the twentieth century, electronic circuits replaced the "
    "gears, and programs stored in memory replaced the plug boards. Each generation of "
    "hardware made the previous one look slow, yet the questions stayed the same: how do we "
    "describe a computation precisely, how much time and memory does it need, and how do we "
    "know that the answer is right? "
)


def long_prompt(tokenizer, min_tokens: int = 1000) -> list[int]:
    """A prompt of at least ``min_tokens`` tokens of varied prose (not one repeated word)."""
    topics = ["weather", "music", "rivers", "mountains", "cities", "trains", "gardens", "bridges",
              "libraries", "oceans", "forests", "deserts", "markets", "harbours", "schools"]
    text, i = "", 0
    while len(tokenizer(text).input_ids) < min_tokens:
        text += _PARAGRAPH + f"A note on {topics[i % len(topics)]}: it changes with the seasons. "
        i += 1
    return tokenizer(text).input_ids
