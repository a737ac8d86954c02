"""Source text names NeMo-RL where it means NeMo-RL's GRPO, never "the seed" (docs/decisions.md).

"The seed" was the project's early shorthand for the implementation it started from; a reader of
the code cannot know that. A random seed is always qualified ("the sampling seed", "grpo.seed"),
so the bare phrase is forbidden outright, in any text file under src/, across comment line breaks.
"""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "grpo_sdk"
PHRASE = re.compile(r"\bthe\s+(?:#\s*)?seed(?:'s)?\b|\bseed users?\b", re.IGNORECASE)


def offending_lines() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*")):
        relative = path.relative_to(SRC).as_posix()
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for match in PHRASE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"src/grpo_sdk/{relative}:{line}: {match.group(0)!r}")
    return found


def test_source_names_nemo_rl_not_the_seed():
    assert offending_lines() == [], "say NeMo-RL (or NeMo-RL's GRPO) where you mean it:\n" + \
        "\n".join(offending_lines())


def test_the_rule_sees_the_phrase_across_comment_lines():
    assert PHRASE.search("as the\n    # seed's layout") and PHRASE.search("The seed refuses")
    assert not PHRASE.search("the sampling seed") and not PHRASE.search("grpo.seed") \
        and not PHRASE.search("seeded by the run's seed")
