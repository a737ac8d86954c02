"""The ``reward_model`` environment: a sequence-classification model scores (prompt, response) pairs.

Every model here is built locally from a tiny config (nothing can be downloaded): a 2-layer
GPT-2 classifier with the built-in character tokenizer (one label; pooled at the last non-pad
token, so padding is what can go wrong) and a 2-layer BERT classifier with a word-piece
vocabulary written here (three named labels; text pairs). Scores are checked against a direct
forward pass of the same model on each input alone. No GPU run happens here: the GPU side is
the resources an environment actor asks Ray for, checked without a GPU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import config_problems, run_grpoctl
from grpo_sdk.config.loading import load_config
from grpo_sdk.core.errors import ConfigError, GrpoSdkError, ModelLoadError
from grpo_sdk.core.records import Message
from grpo_sdk.environments.reward_model import RewardModelEnvironment
from grpo_sdk.environments.specs import RewardModelConfig
from grpo_sdk.plugins.registry import Registry

# Role -> one character the char tokenizer knows; the template ends every conversation with EOS.
CHAT_TEMPLATE = ("{% for m in messages %}{{ {'system': 'a', 'user': '+', 'assistant': '=', 'tool': '>'}[m['role']] }}"
                 "{{ m['content'] }}{% endfor %}{{ eos_token }}")
BERT_WORDS = ["what", "is", "two", "plus", "four", "five", "the", "answer", "yes", "no", "maybe", "it"]


# --- reward models built here, and rule functions the configs name -----------------------------------


def char_tokenizer(chat: bool = False):
    from grpo_sdk.recipes.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def gpt2_classifier(out, *, pad: bool = True, seed: int = 0):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    tokenizer = char_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=128, num_labels=1,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id if pad else None)
    torch.manual_seed(seed)
    GPT2ForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Directories: ``gpt2`` (padded config), ``gpt2_nopad`` (config without pad_token_id),
    ``chat_tokenizer`` (the char tokenizer with a chat template), ``bert`` (3 labels), ``lm`` (a
    causal LM, not a classifier) and ``headless`` (the LM with its config's architectures removed)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    from grpo_sdk.recipes.tiny_model import build_tiny_gpt2

    root = tmp_path_factory.mktemp("reward_models")
    dirs = {"gpt2": gpt2_classifier(root / "gpt2"), "gpt2_nopad": gpt2_classifier(root / "gpt2_nopad", pad=False)}
    char_tokenizer(chat=True).save_pretrained(root / "chat_tokenizer")
    dirs["chat_tokenizer"] = root / "chat_tokenizer"

    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *BERT_WORDS]) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(vocab))
    labels = {0: "bad", 1: "ok", 2: "good"}
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3, id2label=labels,
                        label2id={v: k for k, v in labels.items()})
    torch.manual_seed(1)
    BertForSequenceClassification(config).save_pretrained(root / "bert")
    tokenizer.save_pretrained(root / "bert")
    dirs["bert"] = root / "bert"

    dirs["lm"] = build_tiny_gpt2(root / "lm", seed=0, n_embd=32, n_layer=1, n_head=2)
    dirs["headless"] = build_tiny_gpt2(root / "headless", seed=0, n_embd=32, n_layer=1, n_head=2)
    config_file = dirs["headless"] / "config.json"
    config_file.write_text(json.dumps({k: v for k, v in json.loads(config_file.read_text()).items()
                                       if k != "architectures"}))
    return {k: str(v) for k, v in dirs.items()}


def prompt_length(prompts, completions, **kwargs):
    return [len(c) / 10 for c in completions]


def has_three(completions):
    return [1.0 if "3" in c else None for c in completions]


def quarter(completions):
    return [0.25] * len(completions)


def reward_model(completions):  # named like the model's own component
    return [0.0] * len(completions)


def plain(prompt: str, response: str) -> list[Message]:
    """A log as the trainer builds it for a text prompt."""
    return [Message(role="user", content=prompt, token_ids=(1, 2)), Message(role="assistant", content=response)]


LOGS = [plain("12>", "21"), plain("123456>", "654321"), plain("9>", "9999999999"), plain("40>", "3")]


def direct(model, ids: list[int]) -> torch.Tensor:
    """The model's logits for one input alone: no padding anywhere."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def env_for(models, key="gpt2", **options) -> RewardModelEnvironment:
    return RewardModelEnvironment(RewardModelConfig(model_name=models[key], **options), None)


# --- scores -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["gpt2", "gpt2_nopad"])
def test_scores_equal_a_forward_of_each_input_alone_in_any_batch(models, key):
    from transformers import AutoModelForSequenceClassification

    tokenizer = char_tokenizer()
    model = AutoModelForSequenceClassification.from_pretrained(models[key]).eval()
    expected = [float(direct(model, tokenizer(p[0].content + "\n" + p[1].content)["input_ids"])[0]) for p in LOGS]
    assert len({len(p[1].content) for p in LOGS}) == len(LOGS)  # every batch pads something

    for batch_size in (1, 3, 8):
        env = env_for(models, key, batch_size=batch_size)
        assert env.format == "text" and env.device == "cpu"
        assert env.model.config.pad_token_id == tokenizer.pad_token_id  # set from the tokenizer when missing
        out = env.step(LOGS, [{}] * len(LOGS))
        assert out.rewards["reward_model"] == pytest.approx(expected, abs=1e-5)
        assert out.metrics["truncated_fraction"] == 0.0
        assert out.metrics["logit_mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert len(set(round(v, 4) for v in expected)) == len(expected)  # the inputs really differ


def test_the_chat_template_scores_the_conversation_up_to_the_last_assistant_message(models):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(models["gpt2"]).eval()
    tokenizer = char_tokenizer(chat=True)
    episode = [Message(role="system", content="0"), Message(role="user", content="12"),
               Message(role="assistant", content="1+2"), Message(role="tool", content="3"),
               Message(role="assistant", content="3"), Message(role="environment", content="ff")]
    conversations = [episode, plain("40>", "3")]
    env = env_for(models, tokenizer_name=models["chat_tokenizer"], batch_size=2)
    assert env.format == "chat_template"  # auto: the tokenizer has a template
    rendered = ["a0+12=1+2>3=3<eos>", "+40>=3<eos>"]  # the trailing environment turn is not scored
    expected = [float(direct(model, tokenizer(text, add_special_tokens=False)["input_ids"])[0]) for text in rendered]
    assert env.step(conversations, [{}, {}]).rewards["reward_model"] == pytest.approx(expected, abs=1e-5)

    # format=text: the messages before the first assistant message, then the last response.
    text = env_for(models, tokenizer_name=models["chat_tokenizer"], format="text", separator=">")
    want = float(direct(model, tokenizer("0>12>3")["input_ids"])[0])
    assert text.step([episode], [{}]).rewards["reward_model"] == pytest.approx([want], abs=1e-5)


def test_pairs_labels_normalisation_and_truncation_on_a_three_label_bert(models):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(models["bert"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(models["bert"])
    pairs = [("what is two plus two", "four"), ("what is the answer", "it is five maybe " * 6)]
    logs = [plain(p, r) for p, r in pairs]
    env = env_for(models, "bert", format="pair", label_name="good", normalize="softmax", scale=2.0, shift=-1.0,
                  weight=0.5, max_length=16)
    out = env.step(logs, [{}, {}])
    expected = []
    for p, r in pairs:
        ids = tokenizer(p, r, truncation=True, max_length=16)
        logits = direct_pair(model, ids)
        expected.append(0.5 * (2.0 * float(torch.softmax(logits, -1)[2]) - 1.0))
    assert out.rewards["reward_model"] == pytest.approx(expected, abs=1e-5)
    assert out.metrics["truncated_fraction"] == 0.5
    rows, cut = env.encode(logs)
    assert cut == 1 and len(rows[1]["input_ids"]) == 16
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    assert rows[1]["input_ids"][0] == cls and rows[1]["input_ids"][-1] == sep  # the tokenizer cut it
    assert 1 in rows[1]["token_type_ids"]  # the response is the pair's second segment

    sigmoid = env_for(models, "bert", format="pair", label_index=0, normalize="sigmoid").step(logs[:1], [{}])
    logit = float(direct_pair(model, tokenizer(*pairs[0]))[0])
    assert sigmoid.rewards["reward_model"] == pytest.approx([1 / (1 + math.exp(-logit))], abs=1e-5)


def direct_pair(model, encoding) -> torch.Tensor:
    with torch.inference_mode():
        return model(**{k: torch.tensor([v]) for k, v in encoding.items()}).logits[0].float()


def test_left_truncation_keeps_the_end_of_the_response(models):
    env = env_for(models, max_length=8)
    rows, cut = env.encode([plain("123456789>", "abcdef")])
    tokenizer = char_tokenizer()
    assert cut == 1
    assert tokenizer.convert_ids_to_tokens(rows[0]["input_ids"]) == ["<bos>", "<unk>", *"abcdef"]  # "\n" is <unk>
    right = env_for(models, max_length=8, truncation_side="right").encode([plain("123456789>", "abcdef")])[0]
    assert tokenizer.convert_ids_to_tokens(right[0]["input_ids"]) == ["<bos>", *"1234567"]


# --- rule functions ---------------------------------------------------------------------------------


def test_rule_functions_are_weighted_components_beside_the_model(models):
    config = RewardModelConfig(model_name=models["gpt2"], weight=2.0,
                               rule_functions=["test_reward_model_env:prompt_length", "test_reward_model_env:has_three"],
                               rule_weights=[0.5, 3.0])
    assert config.num_reward_components() == 3
    env = RewardModelEnvironment(config, None)
    alone = env_for(models).step(LOGS, [{}] * 4).rewards["reward_model"]
    out = env.step(LOGS, [{"i": i} for i in range(4)])
    assert set(out.rewards) == {"reward_model", "prompt_length", "has_three"}
    assert out.rewards["reward_model"] == pytest.approx([2.0 * v for v in alone], abs=1e-5)
    assert out.rewards["prompt_length"] == pytest.approx([0.5 * len(log[1].content) / 10 for log in LOGS])
    assert out.rewards["has_three"] == [None, 3.0, None, 3.0]
    assert out.metrics["none_fraction/has_three"] == 0.5

    with pytest.raises(ConfigError, match=r"env.reward_model.rule_functions\[0\].*rename the function"):
        RewardModelEnvironment(RewardModelConfig(model_name=models["gpt2"],
                                                 rule_functions=["test_reward_model_env:reward_model"]), None)
    with pytest.raises(ConfigError, match=r"env.reward_model.rule_functions\[0\].*no module 'nowhere_rules'"):
        RewardModelEnvironment(RewardModelConfig(model_name=models["gpt2"], rule_functions=["nowhere_rules:f"]), None)


def test_gdpo_counts_the_components(models):
    base = ["env.name=reward_model", f"env.reward_model.model_name={models['gpt2']}", "data.train_path=x.jsonl",
            "grpo.adv_estimator.name=gdpo"]
    problems = config_problems(Registry.discover(), *base)
    assert "reports 1" in problems["grpo.adv_estimator.name"]
    problems = config_problems(Registry.discover(), *base, "env.reward_model.rule_functions=[test_reward_model_env:has_three]",
                               "grpo.adv_estimator.gdpo.reward_weights=[1.0,1.0,1.0]")
    assert "3 weights for the 2 reward components" in problems["grpo.adv_estimator.reward_weights"]


# --- errors -------------------------------------------------------------------------------------------


@pytest.fixture
def recipe(tmp_path, models):
    """The built-in recipe on 8 digit prompts (4 x 4 rollouts, no validation) scored by the GPT-2
    reward model."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{n:04d}>"}) + "\n" for n in range(8)))
    from grpo_sdk import recipes

    builtin = Path(recipes.__file__).parent / "tiny_reverse.yaml"
    (tmp_path / "recipe.yaml").write_text(
        f"defaults: {builtin}\ndata: {{train_path: {tmp_path / 'train.jsonl'}}}\n"
        "grpo: {num_prompts_per_step: 4, num_generations_per_prompt: 4, val_period: 0, val_at_end: false}\n"
        "checkpointing: {enabled: false}\n"
        f"env: {{name: reward_model, reward_model: {{model_name: {models['gpt2']}}}}}\n")
    return tmp_path / "recipe.yaml"


@pytest.mark.parametrize("override, key, message", [
    ("env.reward_model.model_name=./no/such/rm", "model_name", "no model directory at ./no/such/rm"),
    ("env.reward_model.model_name={lm}", "model_name", "holds a GPT2LMHeadModel, not a sequence classifier"),
    ("env.reward_model.model_name={bert}", "label_index", "has 3 labels (0='bad', 1='ok', 2='good')"),
    ("env.reward_model.label_index=1", "label_index", "1 is out of range: the model has 1 label(s)"),
    ("env.reward_model.label_name=best", "label_name", "'best' is not a label of the model"),
    ("env.reward_model.normalize=softmax", "normalize", "softmax over one label is always 1"),
    ("env.reward_model.rule_functions=[nowhere_rules:f]", "rule_functions[0]", "no module 'nowhere_rules'"),
    ("env.reward_model.rule_weights=[1.0]", "rule_weights", "1 weights for 0 functions"),
    ("env.reward_model.model_name=", "model_name", "is empty"),
])
def test_config_validate_names_the_key_and_exits_2_without_loading_a_model(cli, recipe, models, monkeypatch,
                                                                           override, key, message):
    monkeypatch.chdir(recipe.parent)
    code, out, err = cli("config", "validate", "-c", str(recipe), override.format(**models))
    assert code == 2, (out, err)
    assert f"env.reward_model.{key}" in err and message in err, err
    assert "Traceback" not in err


def test_the_recipe_validates(cli, recipe, monkeypatch):
    monkeypatch.chdir(recipe.parent)
    code, out, err = cli("config", "validate", "-c", str(recipe), "env.reward_model.rule_functions=[test_reward_model_env:has_three]")
    assert code == 0, err


def test_loading_errors_name_the_key(models, tmp_path):
    with pytest.raises(ModelLoadError, match="env.reward_model.model_name: no model directory at ./nope"):
        env_for({"x": "./nope"}, "x")
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel, not a sequence classifier"):
        env_for(models, "lm")
    with pytest.raises(ModelLoadError, match="lacks score.weight, which would score with random weights"):
        env_for(models, "headless")  # its config does not say what it is; the checkpoint does
    with pytest.raises(ConfigError) as info:
        env_for(models, "bert", label_index=3)
    assert info.value.problems[0][0] == "env.reward_model.label_index"
    with pytest.raises(ConfigError, match="no chat template"):
        env_for(models, format="chat_template")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="env.reward_model"):
        env_for({"x": str(tmp_path)}, "x")


def test_a_run_whose_model_fails_to_load_says_why_without_a_traceback(recipe, models):
    # In a process of its own, as a user runs it: in-process, a logging handler an earlier test bound to
    # pytest's (since closed) capture stream printed "--- Logging error --- Traceback" (full-suite CI run).
    result = run_grpoctl("run", "-c", recipe, "grpo.max_num_steps=1", "env.reward_model.label_index=0",
                         f"env.reward_model.model_name={models['headless']}", cwd=recipe.parent)  # validate cannot tell
    assert result.returncode != 0
    assert "env.reward_model.model_name" in result.stderr and "lacks score.weight" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


# --- training -----------------------------------------------------------------------------------------


def test_a_short_training_run_logs_the_reward_components(recipe, monkeypatch):
    import grpo_sdk

    monkeypatch.chdir(recipe.parent)
    steps = []
    summary = grpo_sdk.train(str(recipe), ["grpo.max_num_steps=2",
                                           "env.reward_model.rule_functions=[test_reward_model_env:quarter]"],
                             run_dir=recipe.parent / "run", on_step=lambda step, m: steps.append(m))
    assert summary.status == "completed" and len(steps) == 2
    for m in steps:
        assert math.isfinite(m["reward/reward_model"]) and m["reward/quarter"] == pytest.approx(0.25)
        assert m["env/truncated_fraction"] == 0.0 and math.isfinite(m["env/logit_mean"])
        assert m["reward/mean"] == pytest.approx(m["reward/reward_model"] + 0.25, abs=1e-5)
    lines = (recipe.parent / "run" / "metrics.jsonl").read_text().splitlines()
    assert "env/logit_mean" in json.loads(lines[-1])


# --- Ray: the pool, and what each actor asks for ------------------------------------------------------


def cluster_of(*overrides):
    return load_config(None, ["cluster.runtime=ray", *overrides], Registry.discover()).cluster


def test_environment_actors_ask_ray_for_the_configured_gpus():
    from grpo_sdk.runtime.ray_runtime import environment_actor_options

    cpu = environment_actor_options(cluster_of("cluster.cpus_per_worker=2", "cluster.env_max_concurrency=3"))
    assert cpu == {"num_cpus": 2.0, "max_concurrency": 3}  # no GPU key at all
    shared = environment_actor_options(cluster_of("cluster.gpus_per_node=2", "cluster.env_gpus_per_worker=0.5",
                                                  "cluster.env_workers=2"))
    assert shared["num_gpus"] == 0.5
    assert environment_actor_options(cluster_of("cluster.gpus_per_node=4", "cluster.env_gpus_per_worker=2"))[
        "num_gpus"] == 2.0


def test_the_gpu_budget_counts_the_environment_actors():
    problems = config_problems(Registry.discover(), "cluster.runtime=ray", "cluster.gpus_per_node=2",
                               "cluster.env_gpus_per_worker=0.6", "cluster.env_workers=2")
    assert "needs 3" in problems["cluster.gpus_per_node"] and "+ 2 for env_workers" in problems["cluster.gpus_per_node"]
    load_config(None, ["cluster.runtime=ray", "cluster.gpus_per_node=2", "cluster.env_gpus_per_worker=0.5",
                       "cluster.env_workers=2"], Registry.discover())  # two actors share one GPU
    assert "needs cluster.runtime=ray" in config_problems(Registry.discover(), "cluster.env_gpus_per_worker=1")[
        "cluster.env_gpus_per_worker"]
    assert "device=cpu" in config_problems(Registry.discover(), "cluster.runtime=ray", "cluster.device=cpu",
                                           "cluster.env_gpus_per_worker=1")["cluster.env_gpus_per_worker"]
    assert "gpus_per_node is 0" in config_problems(Registry.discover(), "cluster.runtime=ray",
                                                   "cluster.env_gpus_per_worker=1")["cluster.env_gpus_per_worker"]
    assert "fraction below 1" in config_problems(Registry.discover(), "cluster.env_gpus_per_worker=1.5")[
        "cluster.env_gpus_per_worker"]


def test_too_few_free_gpus_fail_before_the_environment_actors_start(monkeypatch):
    ray = pytest.importorskip("ray")
    from grpo_sdk.runtime.ray_runtime import RayRuntime

    runtime = RayRuntime.__new__(RayRuntime)  # not connected: only the check runs
    runtime.cluster = cluster_of("cluster.gpus_per_node=3", "cluster.env_gpus_per_worker=0.75", "cluster.env_workers=2")
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 8.0, "GPU": 1.0})
    with pytest.raises(GrpoSdkError, match=r"need 1.5 GPUs .*cluster.env_gpus_per_worker=0.75.* has 1 left"):
        runtime._check_environment_gpus()
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 8.0, "GPU": 2.0})
    runtime._check_environment_gpus()


@pytest.mark.parametrize("assigned, device", [([], "cpu"), (["0"], "cuda")])
def test_an_environment_actor_uses_a_gpu_only_when_ray_gave_it_one(monkeypatch, assigned, device):
    """Ray leaves every GPU visible to an actor that reserved none (simulated: no GPU here)."""
    ray = pytest.importorskip("ray")
    from grpo_sdk.runtime.workers import ComponentWorker, WorkerSpec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: None)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: assigned)
    cfg = load_config(None, [], Registry.discover())
    from grpo_sdk.config.context import RunContext

    context = RunContext(config=cfg, run_dir=".", model_path=".", tokenizer_path=".", device="auto", seed=0,
                         needs_reference=False, eos_token_id=2, pad_token_id=0)
    worker = ComponentWorker()
    info = worker.setup(WorkerSpec(kind="environment", name="reverse_digits", config=None, context=context))
    assert worker.device == device and info["device"] == device


@pytest.mark.slow  # ~35 s on 2 cores: the actors start and each loads the policy or the reward model
@pytest.mark.usefixtures("ray_cluster")
def test_a_short_ray_run_scores_with_a_pool_of_reward_model_actors(recipe, monkeypatch):
    import grpo_sdk

    monkeypatch.chdir(recipe.parent)
    steps = []
    summary = grpo_sdk.train(str(recipe), ["grpo.max_num_steps=1", "cluster.runtime=ray",
                                           "cluster.env_workers=2", "cluster.env_max_concurrency=1"],
                             run_dir=recipe.parent / "ray", on_step=lambda step, m: steps.append(m))
    assert summary.status == "completed" and len(steps) == 1
    assert math.isfinite(steps[0]["reward/reward_model"]) and steps[0]["env/truncated_fraction"] == 0.0
