"""Prompt sources: file formats, templates, long prompts, bad rows, shuffling, mixtures, and the
dataloader state that exact resume relies on.

The tokenizer is a byte-level BPE trained here in a fraction of a second (no hub). Its
post-processor prepends ``<s>`` and its chat template starts with ``{{ bos_token }}``, the
combination that gives a double BOS when a rendered chat is tokenized with special tokens.
"""

from __future__ import annotations

import json
import logging
import random

import pytest

from grpo_sdk.config import schema as C
from grpo_sdk.data import prompts as D
from grpo_sdk.data import prompt_sources as sources
from grpo_sdk.core.errors import ConfigError, DataError
from grpo_sdk.environments.reverse_digits import ReverseDigitsEnvironment
from grpo_sdk.environments.specs import ReverseDigitsConfig

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = "the cat sat on a mat how many apples does she have question answer solve step by".split()
    corpus = [" ".join(rng.choice(words) for _ in range(12)) + " " + str(rng.randint(0, 999)) for _ in range(300)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    hf.chat_template = chat_template
    return hf


@pytest.fixture(scope="module")
def bpe_tokenizer():
    return build_tokenizer()


def make_cfg(seed: int = 42, max_val_samples: int = 256, num_prompts_per_step: int = 1, **data) -> C.MasterConfig:
    return C.MasterConfig(policy=C.PolicyConfig(model_name="unused"), data=C.DataConfig(**data),
                          grpo=C.GRPOConfig(seed=seed, max_val_samples=max_val_samples,
                                            num_prompts_per_step=num_prompts_per_step),
                          env=C.EnvConfig(name="reverse_digits"))


ENV = ReverseDigitsEnvironment(ReverseDigitsConfig(num_digits=5), None)
ROWS = [{"prompt": f"question {i}: how many apples does the cat have", "answer": str(i), "n": i} for i in range(30)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_dataset_dir(path, rows, split=None):
    import datasets

    ds = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({split: ds}) if split else ds).save_to_disk(str(path))
    return path


def texts(prompts):
    return [p.text for p in prompts]


# --- formats and prompt building ----------------------------------------------------------------


def test_every_format_gives_the_same_prompts(tmp_path, bpe_tokenizer):
    paths = [write_jsonl(tmp_path / "d.jsonl", ROWS), write_jsonl(tmp_path / "d.json", ROWS),
             write_parquet(tmp_path / "d.parquet", ROWS), write_dataset_dir(tmp_path / "ds", ROWS),
             write_dataset_dir(tmp_path / "dd", ROWS, split="train")]
    loaded = [sources.make_prompt_source(make_cfg(train_path=str(p), shuffle=False), ENV, bpe_tokenizer, 64).prompts
              for p in paths]
    for prompts in loaded:
        assert [(p.text, p.metadata, p.token_ids) for p in prompts] == [
            (p.text, p.metadata, p.token_ids) for p in loaded[0]]
    assert loaded[0][3].metadata == {"answer": "3", "n": 3}
    assert [p[3].source for p in loaded] == [f"{tmp_path}/d.jsonl line 4", f"{tmp_path}/d.json line 4",
                                             f"{tmp_path}/d.parquet row 3", f"{tmp_path}/ds row 3",
                                             f"{tmp_path}/dd (split train) row 3"]


def test_prompt_template_fills_in_row_keys_and_tokenizes_like_the_rollout(tmp_path, bpe_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:3])
    cfg = make_cfg(train_path=str(path), shuffle=False, prompt_template="Q{n}: {prompt} A:")
    prompts = sources.make_prompt_source(cfg, ENV, bpe_tokenizer, 64).prompts
    assert prompts[2].text == f"Q2: {ROWS[2]['prompt']} A:"
    assert list(prompts[2].token_ids) == bpe_tokenizer(prompts[2].text, add_special_tokens=True)["input_ids"]
    assert prompts[2].token_ids[0] == bpe_tokenizer.bos_token_id


def test_chat_template_ids_are_the_tokenizers_with_one_bos(tmp_path, bpe_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:3])
    cfg = make_cfg(train_path=str(path), shuffle=False, use_chat_template=True, system_prompt="Be brief.",
                   prompt_template="{prompt}?")
    prompt = sources.make_prompt_source(cfg, ENV, bpe_tokenizer, 64).prompts[1]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ROWS[1]["prompt"] + "?"}]
    expected = bpe_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(prompt.token_ids) == list(expected)
    assert prompt.text == bpe_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.text.startswith("<s><|system|>Be brief.\n<|user|>") and prompt.text.endswith("<|assistant|>")
    assert prompt.token_ids.count(bpe_tokenizer.bos_token_id) == 1 and prompt.token_ids[0] == bpe_tokenizer.bos_token_id


def test_chat_template_without_one_in_the_tokenizer_is_a_config_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:3])
    with pytest.raises(ConfigError, match="data.use_chat_template: is true, but the tokenizer .* has no chat_template"):
        sources.make_prompt_source(make_cfg(train_path=str(path), use_chat_template=True), ENV, build_tokenizer(None), 64)


def test_template_key_missing_from_a_row_names_the_row(tmp_path, bpe_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "topic": "x"}, {"prompt": "b"}])
    with pytest.raises(DataError, match=r"d.jsonl line 2: data.prompt_template '\[{topic}\] {prompt}' needs "
                                        r"'topic', which the row lacks"):
        sources.make_prompt_source(make_cfg(train_path=str(path), prompt_template="[{topic}] {prompt}"), ENV, bpe_tokenizer, 64)


# --- long prompts ---------------------------------------------------------------------------------


LONG_ROWS = [{"prompt": "how many apples " * (k + 1), "k": k} for k in range(10)]


def test_long_prompt_is_an_error_naming_the_row_and_the_limit(tmp_path, bpe_tokenizer):
    path = write_parquet(tmp_path / "d.parquet", LONG_ROWS)
    lengths = [len(bpe_tokenizer(r["prompt"])["input_ids"]) for r in LONG_ROWS]
    limit = lengths[5]
    with pytest.raises(DataError, match=rf"d.parquet row 6: prompt is {lengths[6]} tokens, longer than the {limit} "
                                        r"allowed .*data.filter_long_prompts=true drops such prompts"):
        sources.make_prompt_source(make_cfg(train_path=str(path)), ENV, bpe_tokenizer, limit)


def test_long_prompts_are_filtered_and_counted(tmp_path, bpe_tokenizer, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", LONG_ROWS)
    limit = len(bpe_tokenizer(LONG_ROWS[5]["prompt"])["input_ids"])
    with caplog.at_level(logging.WARNING, logger="grpo_sdk.data.prompts"):
        source = sources.make_prompt_source(make_cfg(train_path=str(path), filter_long_prompts=True), ENV, bpe_tokenizer, limit)
    assert len(source.prompts) == 6
    assert sorted(p.metadata["k"] for p in source.prompts) == [0, 1, 2, 3, 4, 5]
    assert "dropped 4 of 10 prompts longer than" in caplog.text and "d.jsonl line 7" in caplog.text
    with pytest.raises(DataError, match="every prompt of .* is longer than 2 tokens"):
        sources.make_prompt_source(make_cfg(train_path=str(path), filter_long_prompts=True), ENV, bpe_tokenizer, 2)


# --- malformed rows -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, rows, message", [
    ("jsonl", [{"prompt": "a"}, {"question": "b"}], r"d.jsonl line 2: no 'prompt' key \(data.prompt_key\) and no "
                                                    r"'messages'; keys: \['question'\]"),
    ("jsonl", [{"prompt": "a"}, ["b"]], r"d.jsonl line 2: expected an object with a 'prompt' key, got list"),
    ("jsonl", [{"prompt": "a"}, {"prompt": 7}], r"d.jsonl line 2: 'prompt' must be a non-empty string \(or a list "
                                                r"of messages\), got 7"),
    ("parquet", [{"question": "a"}, {"question": "b"}], r"d.parquet row 0: no 'prompt' key .*keys: \['question'\]"),
    ("parquet", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": None}], r"d.parquet row 2: 'prompt' must be a "
                                                                       r"non-empty string \(or a list of messages\), "
                                                                       r"got None"),
    ("datasets", [{"prompt": "a"}, {"prompt": ""}], r"ds row 1: 'prompt' must be a non-empty string \(or a list of "
                                                    r"messages\), got ''"),
    ("datasets", [{"prompt": 1}, {"prompt": 2}], r"ds row 0: 'prompt' must be a non-empty string \(or a list of "
                                                 r"messages\), got 1"),
])
def test_malformed_rows_are_named(tmp_path, fmt, rows, message):
    writer = {"jsonl": lambda: write_jsonl(tmp_path / "d.jsonl", rows),
              "parquet": lambda: write_parquet(tmp_path / "d.parquet", rows),
              "datasets": lambda: write_dataset_dir(tmp_path / "ds", rows)}[fmt]
    with pytest.raises(DataError, match=message):
        sources.make_prompt_source(make_cfg(train_path=str(writer())), ENV)


def test_unreadable_inputs_are_named(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "d.csv").write_text("prompt\na\n")
    (tmp_path / "bad.parquet").write_text("not parquet")
    (tmp_path / "notds").mkdir()
    for name, message in [("bad.jsonl", r"bad.jsonl line 2: not valid JSON"),
                          ("empty.jsonl", r"data.train_path: .*empty.jsonl holds no rows"),
                          ("d.csv", r"d.csv: unknown format '.csv'"),
                          ("bad.parquet", r"bad.parquet: not a readable Parquet file"),
                          ("notds", r"notds: not a directory saved by datasets' save_to_disk"),
                          ("missing.jsonl", r"missing.jsonl: no such file or directory")]:
        with pytest.raises(DataError, match=message):
            sources.make_prompt_source(make_cfg(train_path=str(tmp_path / name)), ENV)


def test_bytes_fifos_and_depth_are_named_by_file_and_line(tmp_path):
    import os

    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    (tmp_path / "utf16.jsonl").write_text('{"prompt": "a"}\n', encoding="utf-16")
    (tmp_path / "deep.jsonl").write_text('{"prompt": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    os.mkfifo(tmp_path / "pipe.jsonl")  # opening it would block: it must be refused before
    for name, message in [("latin1.jsonl", r"latin1.jsonl line 2: not UTF-8 \(byte 0xe9 at column 16\)"),
                          ("utf16.jsonl", r"utf16.jsonl line 1: not UTF-8 \(byte 0xff at column 1\) \(it looks "
                                          r"like UTF-16\)"),
                          ("deep.jsonl", r"deep.jsonl line 2: nested too deeply"),
                          ("pipe.jsonl", r"pipe.jsonl: is a FIFO \(named pipe\), not a regular file")]:
        with pytest.raises(DataError, match=message):
            sources.make_prompt_source(make_cfg(train_path=str(tmp_path / name)), ENV)
    with pytest.raises(DataError, match=r"pipe.jsonl: is a FIFO"):
        sources.make_validation_prompts(make_cfg(validation_path=str(tmp_path / "pipe.jsonl")), ENV)


def test_a_template_that_does_not_fit_a_row_names_the_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "n": 1}, {"prompt": "b", "n": "two"}])
    with pytest.raises(DataError, match=r"d.jsonl line 2: data.prompt_template '{n:03d} {prompt}' cannot be filled "
                                        r"from this row: Unknown format code 'd'"):
        sources.make_prompt_source(make_cfg(train_path=str(path), prompt_template="{n:03d} {prompt}"), ENV)


def test_a_dataset_smaller_than_a_step_is_refused(tmp_path):
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS[:3]))
    with pytest.raises(DataError, match=r"data.train_path: .*d.jsonl holds 3 prompts, fewer than the "
                                        r"grpo.num_prompts_per_step=4 every step draws"):
        sources.make_prompt_source(make_cfg(train_path=path, num_prompts_per_step=4), ENV)
    assert len(sources.make_prompt_source(make_cfg(train_path=path, num_prompts_per_step=3), ENV).prompts) == 3
    other = str(write_jsonl(tmp_path / "e.jsonl", ROWS[:2]))
    mixed = make_cfg(num_prompts_per_step=6, use_multiple_dataloader=True,
                     datasets=[C.DatasetConfig(path=path), C.DatasetConfig(path=other)])
    with pytest.raises(DataError, match=r"data.datasets: .*d.jsonl, .*e.jsonl holds 5 prompts, fewer than"):
        sources.make_prompt_source(mixed, ENV)
    # A validation set is a prefix of at most max_val_samples rows: a small one is fine.
    assert len(sources.make_validation_prompts(make_cfg(validation_path=path, num_prompts_per_step=8), ENV)) == 3


# --- order and epochs -----------------------------------------------------------------------------


def draw(source, steps, count):
    return [texts(source.next_prompts(count)) for _ in range(steps)]


def test_shuffle_is_a_fresh_permutation_per_epoch_seeded_by_seed_and_epoch(tmp_path):
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    build = lambda seed, shuffle=True: sources.make_prompt_source(make_cfg(seed, train_path=path, shuffle=shuffle), ENV)
    epochs = [texts(build(1).next_prompts(90))[i * 30:(i + 1) * 30] for i in range(3)]
    assert all(sorted(e) == sorted(r["prompt"] for r in ROWS) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert texts(build(1).next_prompts(90)) == sum(epochs, [])  # same seed: same order
    assert texts(build(2).next_prompts(30)) != epochs[0]
    assert texts(build(1, shuffle=False).next_prompts(60)) == [r["prompt"] for r in ROWS] * 2


def test_epochs_count_completed_passes(tmp_path):
    source = sources.make_prompt_source(make_cfg(train_path=str(write_jsonl(tmp_path / "d.jsonl", ROWS[:10]))), ENV)
    seen = []
    for _ in range(6):
        source.next_prompts(4)
        seen.append(source.epoch)
    assert seen == [0, 0, 1, 1, 2, 2]  # 4, 8, 12, 16, 20, 24 prompts drawn of 10


# --- mixtures -------------------------------------------------------------------------------------


def mixture(tmp_path, weights, sizes, **data):
    datasets = []
    for i, (w, n) in enumerate(zip(weights, sizes)):
        key = "question" if i == 1 else "prompt"  # the second dataset uses its own prompt_key
        path = write_jsonl(tmp_path / f"mix{i}.jsonl", [{key: f"d{i} row {j}", "ds": i} for j in range(n)])
        datasets.append(C.DatasetConfig(path=str(path), weight=w, prompt_key=key if i == 1 else None))
    return sources.make_prompt_source(make_cfg(use_multiple_dataloader=True, datasets=datasets, **data), ENV)


@pytest.mark.parametrize("weights, count, steps, expected", [
    ([3, 1], 4, 10, [30, 10]),
    ([1, 1, 1], 4, 30, [40, 40, 40]),
    ([0.5, 0.25, 0.25], 5, 100, [250, 125, 125]),
])
def test_mixture_splits_prompts_by_weight_exactly(tmp_path, weights, count, steps, expected):
    source = mixture(tmp_path, weights, [7, 5, 3][:len(weights)])
    per_step = [[p.metadata["ds"] for p in source.next_prompts(count)] for _ in range(steps)]
    assert [sum(s.count(i) for s in per_step) for i in range(len(weights))] == expected
    if weights == [3, 1]:
        assert all(s.count(0) == 3 and s.count(1) == 1 for s in per_step)  # every step, not just overall


def test_mixture_names_datasets_cycles_each_and_counts_epochs_by_the_slowest(tmp_path):
    source = mixture(tmp_path, [1, 1], [6, 2])
    prompts = source.next_prompts(4)
    assert prompts[1].source == f"{tmp_path}/mix1.jsonl line {int(prompts[1].text.split()[-1]) + 1} (data.datasets[1])"
    assert source.parts[1].epoch == 1 and source.epoch == 0  # dataset 1 went round once, dataset 0 has not
    later = source.next_prompts(8)
    assert sorted(p.text for p in prompts + later if p.metadata["ds"] == 0) == [f"d0 row {j}" for j in range(6)]
    assert source.epoch == 1 and source.parts[1].epoch == 3


# --- state for exact resume -----------------------------------------------------------------------


def roundtrip(build, advance):
    original = build()
    advance(original)
    state = json.loads(json.dumps(original.state_dict()))  # what a checkpoint stores
    resumed = build()
    resumed.load_state_dict(state)
    return original, resumed


@pytest.mark.parametrize("drawn", [13, 30, 58])  # mid-epoch, exactly at the boundary, the epoch after
def test_dataset_state_resumes_the_exact_sequence(tmp_path, drawn):
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    original, resumed = roundtrip(lambda: sources.make_prompt_source(make_cfg(train_path=path), ENV),
                                  lambda s: s.next_prompts(drawn))
    assert resumed.epoch == original.epoch == drawn // 30
    assert draw(resumed, 8, 7) == draw(original, 8, 7)  # crosses at least one more epoch boundary


def test_mixture_state_resumes_the_exact_sequence(tmp_path):
    original, resumed = roundtrip(lambda: mixture(tmp_path, [0.6, 0.3, 0.1], [7, 5, 3]),
                                  lambda s: draw(s, 5, 6))
    assert draw(resumed, 20, 6) == draw(original, 20, 6)


def test_environment_state_resumes_the_exact_sequence(bpe_tokenizer):
    build = lambda: sources.make_prompt_source(make_cfg(), ENV, bpe_tokenizer, 64)
    original, resumed = roundtrip(build, lambda s: s.next_prompts(11))
    a, b = resumed.next_prompts(9), original.next_prompts(9)
    assert a == b and a[0].source == "reverse_digits prompt 11" and a[0].token_ids is not None


def test_state_from_other_data_is_refused(tmp_path):
    a = sources.make_prompt_source(make_cfg(train_path=str(write_jsonl(tmp_path / "a.jsonl", ROWS))), ENV)
    b = sources.make_prompt_source(make_cfg(train_path=str(write_jsonl(tmp_path / "b.jsonl", ROWS[:20]))), ENV)
    with pytest.raises(DataError, match=r"does not match this run's data.*size: saved 30, now 20"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(DataError, match=r"saved from a 'dataset' prompt source, but this run reads a 'environment'"):
        sources.make_prompt_source(make_cfg(), ENV).load_state_dict(a.state_dict())


# --- workers, validation, compatibility -----------------------------------------------------------


def test_worker_processes_give_identical_prompts(tmp_path, bpe_tokenizer, monkeypatch):
    monkeypatch.setattr(D, "PARALLEL_MIN_ROWS", 0)  # the real threshold is thousands of rows
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS * 3))
    build = lambda workers: sources.make_prompt_source(make_cfg(train_path=path, num_workers=workers,
                                                          use_chat_template=True), ENV, bpe_tokenizer, 64).prompts
    assert build(2) == build(1)


def test_validation_prompts_are_fixed_and_apart_from_training(tmp_path, bpe_tokenizer):
    cfg = make_cfg(seed=3, max_val_samples=16)
    first, second = (sources.make_validation_prompts(cfg, ENV, bpe_tokenizer, 64) for _ in range(2))
    assert first == second and len(first) == 16
    assert texts(first) != texts(sources.make_prompt_source(cfg, ENV, bpe_tokenizer, 64).next_prompts(16))
    path = str(write_jsonl(tmp_path / "val.jsonl", ROWS))
    from_file = sources.make_validation_prompts(make_cfg(max_val_samples=5, validation_path=path, shuffle=True), ENV)
    assert texts(from_file) == [r["prompt"] for r in ROWS[:5]]  # file order, never shuffled
    assert sources.make_validation_prompts(make_cfg(), object()) is None


def test_without_a_tokenizer_prompts_carry_no_token_ids(tmp_path):
    """The loop's two-argument call keeps working: the rollout then tokenizes and length-checks."""
    source = sources.make_prompt_source(make_cfg(train_path=str(write_jsonl(tmp_path / "d.jsonl", ROWS))), ENV)
    assert all(p.token_ids is None for p in source.next_prompts(5))
    assert sources.make_prompt_source(make_cfg(), ENV).next_prompts(2)[0].token_ids is None


# --- conversational rows (messages) ---------------------------------------------------------------


CHATS = [{"messages": [{"role": "user", "content": f"how many apples {i}"}], "answer": str(i)} for i in range(6)]


def test_messages_rows_are_rendered_with_the_chat_template(tmp_path, bpe_tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    prompts = sources.make_prompt_source(make_cfg(train_path=str(path), shuffle=False), ENV, bpe_tokenizer, 64).prompts
    messages = [{"role": "user", "content": "how many apples 2"}]
    assert prompts[2].messages == tuple(messages) and prompts[2].metadata == {"answer": "2"}
    assert prompts[2].text == bpe_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert list(prompts[2].token_ids) == list(bpe_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert prompts[2].token_ids.count(bpe_tokenizer.bos_token_id) == 1  # the template's BOS, not a second one


def test_a_prompt_key_holding_messages_is_conversational_and_plain_rows_may_mix(tmp_path, bpe_tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "the cat"}]}, {"prompt": "the cat"}]
    prompts = D.load_prompts(write_jsonl(tmp_path / "mixed.jsonl", rows), prompt_key="prompt",
                             builder=D.make_builder(make_cfg().data, bpe_tokenizer), max_prompt_tokens=64,
                             filter_long=False)
    assert prompts[0].messages == ({"role": "user", "content": "the cat"},)
    assert prompts[0].text.endswith("<|assistant|>")
    assert prompts[1].messages is None and prompts[1].text == "the cat"
    assert list(prompts[1].token_ids) == bpe_tokenizer("the cat")["input_ids"]


def test_messages_rows_from_parquet(tmp_path, bpe_tokenizer):
    path = write_parquet(tmp_path / "chat.parquet", CHATS)
    prompts = sources.make_prompt_source(make_cfg(train_path=str(path), shuffle=False), ENV, bpe_tokenizer, 64).prompts
    assert prompts[4].messages == ({"role": "user", "content": "how many apples 4"},)
    assert prompts[4].source == f"{path} row 4"


def test_the_system_prompt_goes_first_unless_the_row_has_one(tmp_path, bpe_tokenizer):
    rows = [CHATS[0], {"messages": [{"role": "system", "content": "Own."}, {"role": "user", "content": "hi"}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    prompts = sources.make_prompt_source(make_cfg(train_path=str(path), shuffle=False, system_prompt="Be brief."), ENV,
                                   bpe_tokenizer, 64).prompts
    assert [m["role"] for m in prompts[0].messages] == ["system", "user"]
    assert prompts[0].messages[0]["content"] == "Be brief." and prompts[0].text.startswith("<s><|system|>Be brief.")
    assert [m["content"] for m in prompts[1].messages] == ["Own.", "hi"]


@pytest.mark.parametrize("messages, message", [
    ("how many", r"line 1: 'messages' must be a non-empty list of \{\"role\": ..., \"content\": ...\} messages, "
                 r"got str 'how many'"),
    ([], r"line 1: 'messages' must be a non-empty list"),
    (["hi"], r"line 1: messages\[0\] must be an object with 'role' and 'content', got str 'hi'"),
    ([{"role": "user"}], r"line 1: messages\[0\] has no 'content' key; keys: \['role'\]"),
    ([{"content": "x"}, {"role": "user", "content": "y"}], r"messages\[0\] has no 'role' key"),
    ([{"role": "", "content": "x"}], r"messages\[0\]: 'role' must be a non-empty string"),
    ([{"role": "user", "content": 3}], r"messages\[0\]: 'content' must be a string, got int 3"),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
     r"line 1: the last message of 'messages' is the assistant's, so the prompt would show the model its answer"),
    ([{"role": "user", "content": " "}], r"every message of 'messages' is empty"),
])
def test_malformed_messages_are_named_by_row_and_message(tmp_path, bpe_tokenizer, messages, message):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages, "answer": "1"}])
    with pytest.raises(DataError, match=message):
        sources.make_prompt_source(make_cfg(train_path=str(path), num_prompts_per_step=1), ENV, bpe_tokenizer, 64)


def test_messages_without_a_chat_template_name_the_row(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "plain"}, *CHATS])
    with pytest.raises(DataError, match=r"chat.jsonl line 2: a conversational row \(messages\) is rendered with the "
                                        r"tokenizer's chat template, but the tokenizer .* has none"):
        sources.make_prompt_source(make_cfg(train_path=str(path)), ENV, build_tokenizer(None), 64)


def test_a_template_the_chat_template_rejects_names_the_row(tmp_path):
    strict = build_tokenizer("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                             "{% endif %}{{ m['content'] }}{% endfor %}")
    rows = [*CHATS[:2], {"messages": [{"role": "tool", "content": "x"}, {"role": "user", "content": "y"}]}]
    with pytest.raises(DataError, match=r"chat.jsonl line 3: the tokenizer's chat template cannot render this "
                                        r"conversation: TemplateError: no tools"):
        sources.make_prompt_source(make_cfg(train_path=str(write_jsonl(tmp_path / "chat.jsonl", rows))), ENV, strict, 64)


def test_a_prompt_template_is_refused_for_messages_rows(tmp_path, bpe_tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    with pytest.raises(DataError, match=r"line 1: data.prompt_template formats plain-text prompts, but this row is "
                                        r"conversational"):
        sources.make_prompt_source(make_cfg(train_path=str(path), prompt_template="Q: {prompt}"), ENV, bpe_tokenizer, 64)


def test_messages_rows_without_a_tokenizer_are_rendered_by_the_rollout_alike(tmp_path, bpe_tokenizer):
    from grpo_sdk.rollouts.rollout import tokenize_prompts

    path = str(write_jsonl(tmp_path / "chat.jsonl", CHATS))
    bare = sources.make_prompt_source(make_cfg(train_path=path, shuffle=False), ENV).prompts
    loaded = sources.make_prompt_source(make_cfg(train_path=path, shuffle=False), ENV, bpe_tokenizer, 64).prompts
    assert all(p.token_ids is None and p.messages is not None for p in bare)
    assert tokenize_prompts(bpe_tokenizer, bare, 64) == [list(p.token_ids) for p in loaded]
    assert sources._fingerprint(bare) != sources._fingerprint(sources.make_prompt_source(
        make_cfg(train_path=str(write_jsonl(tmp_path / "other.jsonl", CHATS[::-1])), shuffle=False), ENV).prompts)
