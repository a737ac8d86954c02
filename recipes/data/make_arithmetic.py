"""Arithmetic word problems for recipes/smollm2-arithmetic.yaml, generated deterministically.

    python recipes/data/make_arithmetic.py          # rewrites arithmetic_train.jsonl and arithmetic_val.jsonl

One-step problems (addition and subtraction with numbers up to 60, multiplication up to 12 x 12)
in a few everyday phrasings. The validation split comes first from its own seed; the training
split then skips every (operation, numbers) pair the validation split uses, so no held-out
problem, in any phrasing, is seen in training. The same script and seeds always give the same
files (tests/e2e/test_recipes.py checks the committed files against it).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ("Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Leo", "Zoe", "Max", "Ella", "Jack", "Nora")
ITEMS = ("apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "cards", "shells", "stamps")
PHRASINGS = {
    "+": ("{n} has {a} {item}. {n} gets {b} more. How many {item} does {n} have now?",
          "There are {a} {item} in a box and {b} {item} on the table. How many {item} are there in all?"),
    "-": ("{n} has {a} {item} and gives away {b}. How many {item} does {n} have left?",
          "A shop had {a} {item}. It sold {b} of them. How many {item} are left?"),
    "x": ("{n} has {a} bags with {b} {item} in each bag. How many {item} does {n} have?",
          "There are {a} rows of {item} with {b} {item} in each row. How many {item} are there?"),
}
TRAIN_ROWS, VAL_ROWS = 4000, 128
TRAIN_SEED, VAL_SEED = 1, 2


def problem(rng: random.Random) -> tuple[tuple[str, int, int], dict[str, str]]:
    """One problem: its (operation, a, b) key and its row {"prompt", "answer"}."""
    op = rng.choice("+-x")
    if op == "+":
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        answer = a + b
    elif op == "-":
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        answer = a - b
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        answer = a * b
    text = rng.choice(PHRASINGS[op]).format(n=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
    return (op, a, b), {"prompt": text, "answer": str(answer)}


def make_splits() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    val, seen = [], set()
    rng = random.Random(VAL_SEED)
    while len(val) < VAL_ROWS:
        key, row = problem(rng)
        if key not in seen:
            seen.add(key)
            val.append(row)
    rng = random.Random(TRAIN_SEED)
    train = []
    while len(train) < TRAIN_ROWS:
        key, row = problem(rng)
        if key not in seen:  # repeats within training are fine; nothing held out is trained on
            train.append(row)
    return train, val


def write(rows: list[dict[str, str]], path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    here = Path(__file__).parent
    train, val = make_splits()
    write(train, here / "arithmetic_train.jsonl")
    write(val, here / "arithmetic_val.jsonl")
    print(f"wrote {len(train)} training and {len(val)} validation problems to {here}")
