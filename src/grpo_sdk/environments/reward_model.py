"""A Hugging Face sequence-classification reward model: the ``reward_model`` environment.

::

    env:
      name: reward_model
      reward_model:
        model_name: /models/Skywork-Reward-V2-Qwen3-0.6B    # or a hub name
        batch_size: 16
        rule_functions: [my_rewards:format_ok]              # optional, as env.reward_functions
        rule_weights: [0.2]

* **The pair.** The response is the content of a log's last assistant message; the prompt is
  what came before. ``format: chat_template`` (what ``auto`` picks when the reward model's
  tokenizer has a chat template, as real reward models do) renders the conversation up to and
  including the last assistant message with that template, so a multi-turn episode (user,
  assistant, tool, assistant...) is scored whole; role ``environment`` is passed as ``user``,
  the others as they are. ``pair`` encodes (prompt, response) as the tokenizer's text pair
  (``[CLS] p [SEP] r [SEP]`` for BERT-style cross-encoders); ``text`` is ``prompt + separator +
  response`` as one text. For both the prompt is the messages before the first assistant
  message, joined by ``separator``.
* **Plain-text prompts** reach the environment as the model saw them: with
  ``data.use_chat_template`` that is the *policy's* rendered template, which the reward model's
  template would wrap again. Give conversational rows (``messages``) to score with the reward
  model's own template.
* **The score.** A one-label model's logit, else the logit ``label_index`` (or ``label_name``)
  picks; ``normalize`` (none, sigmoid, or softmax over the labels), then ``scale * x + shift``,
  then ``weight``: that is the ``reward_model`` component. Each rule function is a component
  named after it (``weight * output``, exactly as in ``reward_functions``); the total reward is
  their sum.
* **Batches.** Inputs are sorted by length and scored ``batch_size`` at a time, right-padded
  with the model config's ``pad_token_id`` (set from the tokenizer's pad, else its EOS, when the
  config has none): GPT-style classifiers read the last token that is not padding, BERT-style
  ones the first; either way a row scores the same alone or in any batch. An input over
  ``max_length`` tokens is cut at ``truncation_side`` (by the tokenizer, so special tokens stay)
  and counted in ``env/truncated_fraction``.
* **Where it runs.** In the run's process, or with ``cluster.runtime=ray`` in
  ``cluster.env_workers`` actors, each with ``cluster.env_gpus_per_worker`` GPUs (0: CPU only);
  ``device: auto`` uses a GPU exactly when the process was given one. One actor scores one
  call at a time (a lock): calls beyond that queue, since one model on one device gains nothing
  from running forward passes side by side.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from grpo_sdk.environments.reward_functions import RewardFunctionsEnvironment
from grpo_sdk.environments.specs import RM, RewardFunctionsConfig, RewardModelConfig, classifier_problem, label_problems
from grpo_sdk.plugins import ConfigError, EnvironmentReturn, EnvironmentStepError, MessageLog, ModelLoadError
from grpo_sdk.plugins.toolkit import load_pretrained

COMPONENT = "reward_model"
ROLES = {"environment": "user"}  # chat templates know system, user, assistant (and tool)


def pick_device(requested: str, context: Any) -> str:
    import torch

    if requested == "cpu":
        return "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError([(f"{RM}.device", "is cuda, but torch sees no CUDA device in this process; on Ray "
                                "give environment actors GPUs with cluster.env_gpus_per_worker")])
        return "cuda"
    given = getattr(context, "device", None)  # the run's device; a Ray actor's says whether it got a GPU
    if given in ("cpu", "cuda"):
        return given if given == "cpu" or torch.cuda.is_available() else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_reward_model(config: RewardModelConfig, device: str) -> tuple[Any, Any]:
    """The classifier (eval mode, on ``device``) and its tokenizer; a ModelLoadError names the key."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    key = f"{RM}.model_name"
    remote = {"trust_remote_code": True} if config.trust_remote_code else {}
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        config.dtype, torch.bfloat16 if device == "cuda" else torch.float32)
    tokenizer_key = f"{RM}.tokenizer_name" if config.tokenizer_name else key
    try:
        tokenizer = load_pretrained(AutoTokenizer.from_pretrained, config.tokenizer_name or config.model_name,
                                    tokenizer_key, **remote)
    except (ValueError, KeyError) as exc:  # no tokenizer files, or a tokenizer class transformers lacks
        raise ModelLoadError(f"{tokenizer_key}: no usable tokenizer at {config.tokenizer_name or config.model_name}: "
                             f"{_first_line(exc)}") from exc
    try:
        model, info = load_pretrained(AutoModelForSequenceClassification.from_pretrained, config.model_name, key,
                                      dtype=dtype, output_loading_info=True, **remote)
    except (ValueError, KeyError) as exc:  # "Unrecognized configuration class": no classification head for it
        raise ModelLoadError(f"{key}: {config.model_name} cannot be loaded as a sequence classifier: "
                             f"{_first_line(exc)}") from exc
    problem = classifier_problem({"architectures": getattr(model.config, "architectures", None),
                                  "auto_map": getattr(model.config, "auto_map", None)})
    missing = list(info.get("missing_keys") or [])
    if problem:
        raise ModelLoadError(f"{key}: {config.model_name} {problem}")
    if missing:
        raise ModelLoadError(f"{key}: {config.model_name}: its checkpoint lacks {', '.join(sorted(missing)[:5])}"
                             f"{' and more' if len(missing) > 5 else ''}, which would score with random weights; "
                             "use a trained reward model (a sequence classifier with its head)")
    if model.config.pad_token_id is None:  # GPT-style classifiers need it to find each row's last token
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ModelLoadError(f"{key}: neither the model config nor the tokenizer has a pad or EOS token; set "
                                 "pad_token_id in its config.json")
        model.config.pad_token_id = pad
    return model.to(device).eval(), tokenizer


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def label_index(config: RewardModelConfig, model_config: Any) -> int:
    """The logit that is the reward (what ``label_problems`` accepts)."""
    described = {"id2label": dict(model_config.id2label or {}), "label2id": dict(model_config.label2id or {}),
                 "num_labels": model_config.num_labels}
    problems = label_problems(config, described)
    if problems:
        raise ConfigError(problems)
    if config.label_name is not None:
        return int(model_config.label2id[config.label_name])
    return config.label_index or 0


def conversation_of(log: MessageLog, index: int, separator: str) -> tuple[list[dict[str, str]], str, str]:
    """``(messages up to the last assistant message, prompt text, response)`` of one log; the
    prompt text is the messages before the first assistant message, joined by ``separator``."""
    assistant = [i for i, m in enumerate(log) if m.role == "assistant"]
    if not assistant:
        raise EnvironmentStepError(f"{RM}: sample {index} has no assistant message to score "
                                   f"(roles: {[m.role for m in log]})")
    messages = [{"role": ROLES.get(m.role, m.role), "content": m.content} for m in log[:assistant[-1] + 1]]
    return messages, separator.join(m.content for m in log[:assistant[0]]), log[assistant[-1]].content


class RewardModelEnvironment:
    """Example::

        env = RewardModelEnvironment(RewardModelConfig(model_name="/models/rm"), None)
        log = [Message(role="user", content="2+2?"), Message(role="assistant", content="4")]
        env.step([log], [{}]).rewards   # {"reward_model": [1.73]}
    """

    def __init__(self, config: RewardModelConfig | None, context: Any):
        if config is None or not config.model_name:
            raise ConfigError([(f"{RM}.model_name", "is empty: name a reward model directory (or hub name)")])
        self.config = config
        self.rules: RewardFunctionsEnvironment | None = None
        if config.rule_functions:  # first: a bad function fails before a large model loads
            self.rules = RewardFunctionsEnvironment(
                RewardFunctionsConfig(functions=list(config.rule_functions), weights=config.rule_weights), context,
                key=f"{RM}.rule_functions", weights_key=f"{RM}.rule_weights")
            for i, rf in enumerate(self.rules.functions):
                if rf.name == COMPONENT:
                    raise ConfigError([(f"{RM}.rule_functions[{i}]", f"{rf.entry!r} is named {COMPONENT!r}, the "
                                        "model's own component; rename the function")])
        self.device = pick_device(config.device, context)
        self.model, self.tokenizer = load_reward_model(config, self.device)
        self.label = label_index(config, self.model.config)
        self.format = config.format
        if self.format == "auto":
            self.format = "chat_template" if getattr(self.tokenizer, "chat_template", None) else "text"
        elif self.format == "chat_template" and not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError([(f"{RM}.format", f"is chat_template, but the tokenizer of {config.model_name} has "
                                "no chat template; use text or pair (or auto)")])
        self.tokenizer.truncation_side = config.truncation_side
        # What forward takes: some tokenizers return token_type_ids that a Llama-style model rejects.
        import inspect

        self.inputs = set(inspect.signature(self.model.forward).parameters)
        self._lock = threading.Lock()  # a fast tokenizer is not safe to call from two threads at once

    def runs_on_main_thread(self) -> bool:
        """With rule functions, as reward_functions: they may use signal-based timeouts (math-verify)."""
        return self.rules is not None

    def step(self, message_logs: Sequence[MessageLog], metadata: Sequence[dict[str, Any]]) -> EnvironmentReturn:
        with self._lock:
            logits, truncated = self.score(message_logs)
        values = self.normalized(logits)
        c = self.config
        rewards: dict[str, list[float | None]] = {COMPONENT: [c.weight * (c.scale * v + c.shift) for v in values]}
        n = max(1, len(message_logs))
        metrics = {"truncated_fraction": truncated / n,
                   "logit_mean": sum(row[self.label] for row in logits) / n}
        if self.rules is not None:
            ruled = self.rules.step(message_logs, metadata)
            rewards.update(ruled.rewards)
            metrics.update(ruled.metrics)
        return EnvironmentReturn(rewards=rewards, metrics=metrics)

    def normalized(self, logits: list[list[float]]) -> list[float]:
        import math

        out = []
        for row in logits:
            x = row[self.label]
            if self.config.normalize == "sigmoid":
                x = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
            elif self.config.normalize == "softmax":
                top = max(row)
                x = math.exp(x - top) / sum(math.exp(v - top) for v in row)
            out.append(x)
        return out

    def encode(self, message_logs: Sequence[MessageLog]) -> tuple[list[dict[str, list[int]]], int]:
        """Each log's model inputs (unpadded) and how many were cut to max_length."""
        sep = self.config.separator
        conversations = [conversation_of(log, i, sep) for i, log in enumerate(message_logs)]
        if self.format == "chat_template":
            try:
                texts = [self.tokenizer.apply_chat_template(messages, tokenize=False) for messages, _, _ in
                         conversations]
            except Exception as exc:  # noqa: BLE001 - Jinja's errors, and whatever a template raises
                raise EnvironmentStepError(f"{RM}: the reward model's chat template cannot render the conversation "
                                           f"({type(exc).__name__}: {exc}); format: text or pair avoid it") from exc
            args, special = (texts,), False  # the template holds the special tokens
        elif self.format == "pair":
            args, special = ([p for _, p, _ in conversations], [r for _, _, r in conversations]), True
        else:
            args, special = ([p + sep + r for _, p, r in conversations],), True
        full = self.tokenizer(*args, add_special_tokens=special)
        rows = [{k: list(full[k][i]) for k in full.keys()} for i in range(len(message_logs))]
        long = [i for i, row in enumerate(rows) if len(row["input_ids"]) > self.config.max_length]
        if long:  # the tokenizer cuts them, so a pair keeps [CLS] ... [SEP] ... [SEP]
            cut = self.tokenizer(*([a[i] for i in long] for a in args), add_special_tokens=special, truncation=True,
                                 max_length=self.config.max_length)
            for j, i in enumerate(long):
                rows[i] = {k: list(cut[k][j]) for k in cut.keys()}
        return rows, len(long)

    def score(self, message_logs: Sequence[MessageLog]) -> tuple[list[list[float]], int]:
        """Every log's logits (one list per log, in order) and the number of inputs cut."""
        import torch

        rows, truncated = self.encode(message_logs)
        logits: list[list[float]] = [[] for _ in rows]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]["input_ids"]))  # little padding per batch
        pad = self.model.config.pad_token_id
        for start in range(0, len(order), self.config.batch_size):
            chunk = order[start:start + self.config.batch_size]
            width = max(len(rows[i]["input_ids"]) for i in chunk)
            batch = {}
            for key in (k for k in rows[chunk[0]] if k in self.inputs):
                fill = pad if key == "input_ids" else 0
                batch[key] = torch.tensor([rows[i][key] + [fill] * (width - len(rows[i][key])) for i in chunk],
                                          dtype=torch.long, device=self.device)
            with torch.inference_mode():
                out = self.model(**batch).logits.float().cpu()
            for i, row in zip(chunk, out.tolist()):
                logits[i] = row
        return logits, truncated

    def shutdown(self) -> None:
        if self.rules is not None:
            self.rules.shutdown()
        self.model = None
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()
