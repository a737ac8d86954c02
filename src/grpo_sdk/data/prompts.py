"""Where prompts come from: dataset files, a weighted mixture of them, or an environment that
makes its own (synthetic tasks).

Files: JSON lines (``.jsonl``, ``.json``), Parquet (``.parquet``) or a directory written by
``datasets.Dataset.save_to_disk``. Every row is read, checked, templated and tokenized when the
source is built, so a bad row fails at start-up rather than at step 900, and every prompt
carries a ``source`` label (``"data/train.jsonl line 7"``, ``"data/train.parquet row 17"``;
lines count from 1 as an editor shows them, rows from 0 as ``table[i]`` indexes them).

A row is either plain (its ``data.prompt_key`` holds the prompt text) or conversational (TRL's
format): a ``messages`` key, or a prompt key holding a list of ``{"role", "content"}`` dicts. A
conversational prompt is always rendered with the tokenizer's chat template, ending with the
generation prompt; ``data.system_prompt`` is put first when the row has no system message, and
``data.prompt_template`` (text only) is refused for it. The environment then sees the row's
messages in the message log (see ``rollouts.rollout``).

The sources built from these prompts (dataset, mixture, environment), with their order and exact
resume, are in ``grpo_sdk.data.prompt_sources``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import attrs

from grpo_sdk.core.errors import ConfigError, DataError
from grpo_sdk.core.multi_turn import DeclaresTools
from grpo_sdk.data.files import read_file_rows
from grpo_sdk.data.hub import source_rows

log = logging.getLogger(__name__)

TOO_LONG_HINT = ("(data.max_input_seq_length, or policy.max_total_sequence_length - "
                 "policy.generation.max_new_tokens)")


MESSAGES_KEY = "messages"  # a conversational row's key when it has no data.prompt_key (TRL's name)


@attrs.frozen(kw_only=True)
class Prompt:
    text: str  # after data.prompt_template and the chat template: what the model is shown ("" until rendered)
    metadata: dict[str, Any]  # the row's other keys, passed to the environment
    source: str  # where it came from, for error messages
    token_ids: tuple[int, ...] | None = None  # `text` tokenized once at load; None: the rollout tokenizes it
    # A conversational row's messages, as written (plus data.system_prompt); None for a plain prompt.
    messages: tuple[dict[str, str], ...] | None = None


# --- reading rows ---------------------------------------------------------------------------------


def read_rows(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for every row of a JSONL/JSON/Parquet file or a save_to_disk directory
    (``data.files``); of ``hf:NAME`` and of a ``hub.DataSource`` (split, subset, columns...) through
    ``data.hub``."""
    if not isinstance(path, (str, Path)) or str(path).startswith("hf:"):
        return source_rows(path)
    return read_file_rows(path)


# --- building prompts -----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PromptBuilder:
    """Turns a prompt text into what the model sees, and its token ids.

    With the chat template the conversation is rendered to text and that text is tokenized
    without adding special tokens: the template already holds them (a BOS added again by the
    tokenizer would double it). This is what ``apply_chat_template(tokenize=True)`` does.
    """

    tokenizer: Any = None  # None: no token ids; the rollout tokenizes the text
    template: str | None = None
    system_prompt: str | None = None
    use_chat_template: bool = False
    tools: tuple[dict[str, Any], ...] | None = None  # JSON schemas for the chat template's tools section

    def fill_template(self, text: str, row: dict[str, Any], where: str) -> str:
        if self.template is None:
            return text
        try:
            return self.template.format_map({**row, "prompt": text})
        except (KeyError, IndexError) as exc:
            raise DataError(f"{where}: data.prompt_template {self.template!r} needs {exc}, which the row lacks; "
                            f"keys: {sorted(row)} and 'prompt'") from None
        except (ValueError, TypeError, AttributeError) as exc:  # a format spec that does not fit the row's value
            raise DataError(f"{where}: data.prompt_template {self.template!r} cannot be filled from this row: "
                            f"{exc}") from None

    def encode(self, texts: Sequence[str]) -> tuple[list[str], list[list[int]] | None]:
        """The final texts and their token ids (None without a tokenizer)."""
        texts = list(texts)
        if self.tokenizer is None or not texts:
            return texts, None if self.tokenizer is None else []
        if not self.use_chat_template:
            return texts, self.tokenizer(texts, add_special_tokens=True)["input_ids"]
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        conversations = [[*system, {"role": "user", "content": t}] for t in texts]
        rendered = self.tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True,
                                                      **self.tool_kwargs)
        return rendered, self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    @property
    def tool_kwargs(self) -> dict[str, Any]:
        return {"tools": list(self.tools)} if self.tools else {}

    def with_system(self, messages: Sequence[dict[str, str]]) -> tuple[dict[str, str], ...]:
        """A conversation with ``data.system_prompt`` first, unless it has a system message of its own."""
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            return ({"role": "system", "content": self.system_prompt}, *messages)
        return tuple(messages)

    def encode_conversations(self, conversations: Sequence[Sequence[dict[str, str]]], sources: Sequence[str],
                             ) -> tuple[list[str], list[list[int]] | None]:
        """Conversations rendered by the chat template and their token ids (``("", None)`` per
        conversation without a tokenizer: the rollout renders them)."""
        if self.tokenizer is None:
            return [""] * len(conversations), None
        if not conversations:
            return [], []
        if not getattr(self.tokenizer, "chat_template", None):
            raise DataError(f"{sources[0]}: a conversational row ({MESSAGES_KEY}) is rendered with the tokenizer's "
                            f"chat template, but the tokenizer {getattr(self.tokenizer, 'name_or_path', '')!r} has "
                            "none; use an instruct model's tokenizer (policy.tokenizer.name), or give plain-text "
                            "prompts under data.prompt_key")
        rendered = render_conversations(self.tokenizer, conversations, sources, **self.tool_kwargs)
        return rendered, self.tokenizer(rendered, add_special_tokens=False)["input_ids"]


def render_conversations(tokenizer: Any, conversations: Sequence[Sequence[dict[str, str]]],
                         sources: Sequence[str], **template_kwargs: Any) -> list[str]:
    """The chat template's text of each conversation, ending with the generation prompt; a template
    that rejects one (Jinja's ``raise_exception`` on an unexpected role order) names its row."""
    try:
        return tokenizer.apply_chat_template([list(c) for c in conversations], tokenize=False,
                                             add_generation_prompt=True, **template_kwargs)
    except Exception:  # noqa: BLE001 - find the row the template refused, one at a time
        pass
    out = []
    for conversation, where in zip(conversations, sources):
        try:
            out.append(tokenizer.apply_chat_template(list(conversation), tokenize=False, add_generation_prompt=True,
                                                     **template_kwargs))
        except Exception as exc:  # noqa: BLE001 - Jinja's TemplateError and whatever the template raises
            raise DataError(f"{where}: the tokenizer's chat template cannot render this conversation: "
                            f"{type(exc).__name__}: {exc}") from None
    return out


def check_messages(value: Any, where: str, key: str) -> tuple[dict[str, str], ...]:
    """A conversational prompt as ``{"role", "content"}`` dicts; anything else names the row and the message."""
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                        f"messages, got {_describe(value)}")
    messages = []
    for i, message in enumerate(value):
        at = f"{where}: {key}[{i}]"
        if not isinstance(message, dict):
            raise DataError(f"{at} must be an object with 'role' and 'content', got {_describe(message)}")
        missing = [k for k in ("role", "content") if k not in message]
        if missing:
            raise DataError(f"{at} has no {' or '.join(map(repr, missing))} key; keys: {sorted(map(str, message))}")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role.strip():
            raise DataError(f"{at}: 'role' must be a non-empty string such as 'user', got {_describe(role)}")
        if not isinstance(content, str):
            raise DataError(f"{at}: 'content' must be a string, got {_describe(content)}")
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] == "assistant":
        raise DataError(f"{where}: the last message of {key!r} is the assistant's, so the prompt would show the "
                        "model its answer; keep only the turns before the response (the answer can go in another "
                        "column, for the reward)")
    if not any(m["content"].strip() for m in messages):
        raise DataError(f"{where}: every message of {key!r} is empty")
    return tuple(messages)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:60] + '...'}"


def make_builder(data_cfg: Any, tokenizer: Any, environment: Any = None) -> PromptBuilder:
    """How prompts are rendered; an environment that offers tools (``DeclaresTools``) puts their
    schemas in the chat template's tools section."""
    if data_cfg.use_chat_template:
        if tokenizer is None:
            raise ConfigError([("data.use_chat_template", "needs the tokenizer to build prompts")])
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError([("data.use_chat_template",
                                f"is true, but the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no "
                                "chat_template; use an instruct model's tokenizer, or set it false and use "
                                "data.prompt_template")])
    tools = tuple(environment.tool_schemas()) if isinstance(environment, DeclaresTools) else None
    return PromptBuilder(tokenizer=tokenizer, template=data_cfg.prompt_template, system_prompt=data_cfg.system_prompt,
                         use_chat_template=data_cfg.use_chat_template, tools=tools or None)


# Process-pool tokenization: each worker receives the builder (and its tokenizer) once.
_WORKER_BUILDER: PromptBuilder | None = None
PARALLEL_MIN_ROWS = 2000  # below this, starting the workers costs more than it saves


def _init_worker(builder: PromptBuilder) -> None:
    global _WORKER_BUILDER
    _WORKER_BUILDER = builder


def _encode_in_worker(texts: list[str]) -> tuple[list[str], list[list[int]] | None]:
    assert _WORKER_BUILDER is not None
    return _WORKER_BUILDER.encode(texts)


def encode_texts(builder: PromptBuilder, texts: list[str],
                 num_workers: int) -> tuple[list[str], list[list[int]] | None]:
    """``builder.encode`` over ``texts``, in contiguous chunks on ``num_workers`` processes; same order.

    Only the Python part gains from workers: a fast tokenizer's batch call already runs on every
    core in Rust, while rendering a chat template (Jinja) holds the GIL. Measured on 50k
    GSM8K-length rows, 2 cores: plain text 2.7 s serial, 3.3-3.7 s with 2 processes; chat template
    5.1 s serial, 4.0-4.6 s with 2 processes, 5.6 s with 2 threads. So plain text with a fast
    tokenizer stays serial, and workers are processes. "spawn", not fork: the parent may hold
    torch and tokenizer thread pools, which a forked child inherits in an unknown state (a script
    that builds a source with workers needs the usual ``if __name__ == "__main__":`` guard).
    """
    python_heavy = builder.use_chat_template or not getattr(builder.tokenizer, "is_fast", False)
    if num_workers <= 1 or builder.tokenizer is None or not python_heavy or len(texts) < PARALLEL_MIN_ROWS:
        return builder.encode(texts)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    size = -(-len(texts) // (num_workers * 4))  # a few chunks per worker evens out their speeds
    chunks = [texts[i:i + size] for i in range(0, len(texts), size)]
    with ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_worker, initargs=(builder,)) as pool:
        parts = list(pool.map(_encode_in_worker, chunks))
    return [t for p in parts for t in p[0]], [ids for p in parts for ids in p[1]]


def gym_prompt(row: dict[str, Any]) -> str | None:
    """The prompt of a NeMo-Gym row (``responses_create_params.input``: text, or items whose last user
    message is the prompt, as NeMo-RL classifies it), or None for any other row."""
    params = row.get("responses_create_params")
    items = params.get("input") if isinstance(params, dict) else None
    if isinstance(items, str):
        return items or None
    for item in reversed(items if isinstance(items, list) else []):
        if isinstance(item, dict) and item.get("role") == "user":
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content if isinstance(content, str) and content else None
    return None


def load_prompts(path: str | Path, *, prompt_key: str, builder: PromptBuilder, max_prompt_tokens: int | None,
                 filter_long: bool, num_workers: int = 1, key: str = "data.train_path",
                 label: str = "") -> list[Prompt]:
    """Every prompt of a dataset, checked, templated and tokenized (too long ones dropped with a
    warning that counts them, when ``filter_long``). Plain and conversational rows may mix."""
    texts, metadata, sources, conversations = [], [], [], {}  # conversations: row index -> messages
    for where, row in read_rows(path):
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with a {prompt_key!r} key, got {type(row).__name__}")
        column = prompt_key if prompt_key in row else MESSAGES_KEY if MESSAGES_KEY in row else None
        if column is None and gym_prompt(row):  # a NeMo-Gym row: its last user message is the prompt
            row, column = {**row, prompt_key: gym_prompt(row)}, prompt_key
        if column is None:
            raise DataError(f"{where}: no {prompt_key!r} key (data.prompt_key) and no {MESSAGES_KEY!r}; "
                            f"keys: {sorted(row)}")
        meta = {k: v for k, v in row.items() if k != column}
        text = row[column]
        if column == MESSAGES_KEY or isinstance(text, (list, tuple)):
            if builder.template is not None:
                raise DataError(f"{where}: data.prompt_template formats plain-text prompts, but this row is "
                                f"conversational ({column!r} holds messages); unset data.prompt_template or write "
                                "the wording into the messages")
            conversations[len(texts)] = builder.with_system(check_messages(text, where, column))
            texts.append("")
        elif not isinstance(text, str) or not text:
            raise DataError(f"{where}: {prompt_key!r} must be a non-empty string (or a list of messages), "
                            f"got {text!r}")
        else:
            texts.append(builder.fill_template(text, meta, where))
        metadata.append(meta)
        sources.append(where + label)
    if not texts:
        raise DataError(f"{key}: {path} holds no rows")
    texts, ids = _encode_rows(builder, texts, conversations, sources, num_workers)
    prompts, too_long = [], []
    for i, text in enumerate(texts):
        if ids is not None and max_prompt_tokens is not None and len(ids[i]) > max_prompt_tokens:
            if not filter_long:
                raise DataError(f"{sources[i]}: prompt is {len(ids[i])} tokens, longer than the {max_prompt_tokens} "
                                f"allowed {TOO_LONG_HINT}; data.filter_long_prompts=true drops such prompts")
            too_long.append(sources[i])
            continue
        prompts.append(Prompt(text=text, metadata=metadata[i], source=sources[i],
                              token_ids=tuple(ids[i]) if ids is not None else None, messages=conversations.get(i)))
    if too_long:
        log.warning("%s: dropped %d of %d prompts longer than %d tokens (data.filter_long_prompts), first: %s",
                    path, len(too_long), len(texts), max_prompt_tokens, too_long[0])
    if not prompts:
        raise DataError(f"{key}: every prompt of {path} is longer than {max_prompt_tokens} tokens {TOO_LONG_HINT}")
    return prompts


def _encode_rows(builder: PromptBuilder, texts: list[str], conversations: dict[int, tuple[dict[str, str], ...]],
                 sources: list[str], num_workers: int) -> tuple[list[str], list[list[int]] | None]:
    """``encode_texts`` for the plain rows and the chat template for the conversational ones, in row order."""
    plain = [i for i in range(len(texts)) if i not in conversations]
    chat = sorted(conversations)
    plain_texts, plain_ids = encode_texts(builder, [texts[i] for i in plain], num_workers)
    chat_texts, chat_ids = builder.encode_conversations([conversations[i] for i in chat], [sources[i] for i in chat])
    out_texts: list[str] = [""] * len(texts)
    out_ids: list[list[int]] = [[]] * len(texts)
    for rows, part_texts, part_ids in ((plain, plain_texts, plain_ids), (chat, chat_texts, chat_ids)):
        for j, i in enumerate(rows):
            out_texts[i] = part_texts[j]
            if part_ids is not None:
                out_ids[i] = part_ids[j]
    return out_texts, None if builder.tokenizer is None else out_ids
