"""Writes items.jsonl: 48 multiple-choice questions on what a Python expression evaluates to, each with 4 choices
(the right value and 3 near misses), from fixed templates with a fixed seed, the right value computed by eval."""
import json
import random

rng = random.Random(7)


def expression(kind: int) -> str:
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 9)
    return [f"{a} + {b} * {c}", f"len({list(range(a))})", f"max({rng.sample(range(20), 4)})",
            f"sorted({rng.sample(range(10), 3)})[1]", f"{a * 5} // {b}", f"{a * 5} % {c}", f"sum(range({a}))",
            f"'{rng.choice(['abc', 'tandem', 'spec', 'draft'])}'[{rng.randint(0, 2)}]"][kind]


items = []
while len(items) < 48:
    text = expression(len(items) % 8)
    value = eval(text)  # the fixed templates above
    right = repr(value)
    if isinstance(value, int):
        wrong = {repr(value + d) for d in (-2, -1, 1, 2, 3)} - {right}
    else:
        wrong = {repr(ch) for ch in "abcdefghijklmnopqrst"} - {right}
    choices = [right, *rng.sample(sorted(wrong), 3)]
    rng.shuffle(choices)
    items.append({"question": f">>> {text}\n", "choices": choices, "answer": choices.index(right)})
with open("items.jsonl", "w") as f:
    for item in items:
        f.write(json.dumps(item) + "\n")
