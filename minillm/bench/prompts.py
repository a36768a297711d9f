"""The prompt sets: short instructions, and two kinds of traffic for speculative decoding.

* ``INSTRUCTIONS``: short requests ("Explain how a rainbow forms."): the load generator's
  default prompts (``loadgen.py``, the first twelve) and the questions of the synthetic
  workloads' prompts (``workload.py``'s ``PROMPTS``, all of them).

Chapter 5's two sets, as chat prompts:

* ``grounded``: the answer copies from the prompt -- repeat a passage, fix typos or
  grammar in it, quote a sentence, edit code, summarize by quoting. Prompt lookup
  (the n-gram drafter) finds long runs of the answer in the prompt.
* ``open``: free generation -- stories, explanations, advice. The answer is new text:
  little to look up, and only a drafter that models the language can guess it.

``chat_prompts(tokenizer, name, n)`` applies the model's chat template and returns token
ids; the tasks cycle when n is larger than the list.
"""
from __future__ import annotations

INSTRUCTIONS = [
    "Explain how a rainbow forms.",
    "Write a short poem about the sea.",
    "What are three tips for learning a new language?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue during the day?",
    "Summarize the plot of a detective story in a few sentences.",
    "List some good habits for staying healthy.",
    "How does a bicycle stay upright when it moves?",
    "Tell me a story about a robot who learns to paint.",
    "What is the difference between weather and climate?",
    "Write a friendly email inviting a colleague to lunch.",
    "How do plants turn sunlight into food?",
    "Suggest a plan for a weekend trip to the mountains.",
    "Explain what a computer program is.",
    "Why do cats purr?",
]

_LIGHTHOUSE = (
    "The old lighthouse stood at the end of a narrow stone pier. For more than a hundred years its keepers "
    "climbed the spiral stairs each evening to light the lamp, polish the great glass lens and write the "
    "weather in a thick leather book.")
_SHIPS = (
    "Ships passing the rocky coast watched for its slow white flash, once every ten seconds, and knew where "
    "they were. When the lamp was finally automated, the last keeper moved to the village.")
_PHOTOSYNTHESIS = (
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and oxygen. It takes place in the chloroplasts of leaf cells. The oxygen is released into the "
    "air, and the glucose feeds the plant and everything that eats it.")
_CODE = ("def area(width, height):\n    return width * height\n\n\n"
         "def perimeter(width, height):\n    return 2 * (width + height)\n\n\n"
         "def diagonal(width, height):\n    return (width ** 2 + height ** 2) ** 0.5\n")

# Answers of a few dozen tokens or more, so a benchmark's fixed output length mostly covers
# the answer itself (with EOS ignored, what follows it is no longer grounded).
GROUNDED = [
    "Repeat the following text exactly:\n\n" + _LIGHTHOUSE + " " + _SHIPS,
    "Correct the spelling mistakes in this text and write it out again:\n\nThe old lighthose stood at the end "
    "of a narow stone pier. For more then a hundred years its keepers climbed the spiral stares each evening "
    "to light the lamp, polish the grate glass lens and write the wether in a thick leather book.",
    "Here is a passage:\n\n" + _PHOTOSYNTHESIS + "\n\nQuote the first two sentences of the passage word for word.",
    "Rewrite this text with every word capitalized: " + _SHIPS,
    "Copy this Python code and add a comment line above each function:\n\n" + _CODE,
    "Add type hints to this Python code and return the full code:\n\n" + _CODE,
    "Fix the grammar in this text and write it again: The keepers was climbing the spiral stairs each "
    "evenings to lit the lamp and polishes the great glass lens. Ships passing the rocky coast watches for "
    "its slow white flash and knows where they was.",
    "Rewrite this email with the name Sam replaced by Jordan:\n\nHi Sam, the meeting moved to Thursday at "
    "3 pm in room 204. Please bring the budget report and the slides from last week, and tell Sam's team to "
    "join us. Thanks, Alex",
    "Summarize this passage by quoting its two most important sentences:\n\n" + _LIGHTHOUSE + " " + _SHIPS,
]

OPEN = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms.",
    "What are three tips for learning a new language?",
    "Describe a walk through a forest in autumn.",
    "Write a friendly email inviting a colleague to lunch.",
    "Why do people enjoy music?",
]

TASKS = {"grounded": GROUNDED, "open": OPEN}


def chat_prompts(tokenizer, name: str, n: int | None = None) -> list[list[int]]:
    """n chat prompts (token ids, template applied) of workload ``name``: 'grounded' or 'open'."""
    if name not in TASKS:
        raise ValueError(f"unknown workload {name!r}; valid: {', '.join(TASKS)}")
    tasks = TASKS[name]
    n = len(tasks) if n is None else n
    out = []
    for i in range(n):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": tasks[i % len(tasks)]}],
                                            add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if not isinstance(ids, list) else ids))
    return out


__all__ = ["INSTRUCTIONS", "GROUNDED", "OPEN", "TASKS", "chat_prompts"]
