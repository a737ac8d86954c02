"""The run plan `grpoctl run --dry-run` prints: what the run would do, from the config alone.

Nothing heavy is built or imported (no torch, no model, no tokenizer): the components come from
the registry, the batch shape and cadences from the config, the dataset's size from a cheap count
of its rows (a local file or a ``save_to_disk`` directory), the parameter count from
``cli.model_size``. Example::

    from grpo_sdk.cli.plan import make_plan, run_plan
    print(run_plan(cfg, registry))           # the text --dry-run prints
    plan = make_plan(cfg, registry)          # the same, as numbers
    plan.rows_per_step, plan.steps, plan.memory_bytes["total"]

The memory figures estimate the run's peak resident memory, part by part (``cli/memory_plan.py``:
the process, model and optimizer states, and the larger of a training micro-batch's activations
and logits and the sampler's KV cache); ``longest_prompt`` (what ``--dry-run`` found tokenizing the
data) sharpens the lengths, else the config's bounds are used.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from grpo_sdk.cli.memory_plan import DTYPE_BYTES, adam_moment_bytes, estimate, human_bytes
from grpo_sdk.cli.model_size import ModelSize, model_size
from grpo_sdk.core.capabilities import Capability
from grpo_sdk.core.kinds import COMPONENT_KINDS

if TYPE_CHECKING:
    from grpo_sdk.config.schema import MasterConfig

MAX_SIMULATED_DRAWS = 2_000_000  # a mixture's epochs are simulated draw by draw; ~1 s of Python


@attrs.frozen(kw_only=True)
class RunPlan:
    """What a run would do. ``render()`` is the text; the fields are what tests and callers read."""

    rows_per_step: int
    optimizer_steps_per_step: int
    max_tokens_per_step: int
    steps_requested: int  # grpo.max_num_steps
    steps: int  # what the run does: steps_requested, or fewer when the dataset's epochs run out first
    epoch_steps: int | None  # the steps grpo.max_num_epochs allows; None: an endless or uncounted source
    model: ModelSize
    memory_bytes: dict[str, int]  # part -> bytes; empty when the parameters are not known
    sections: tuple[tuple[str, tuple[str, ...]], ...]

    def render(self) -> str:
        out = []
        for title, lines in self.sections:
            if len(lines) == 1:
                out.append(f"{title}: {lines[0]}")
            else:
                out.append(f"{title}:")
                out.extend(f"  {line}" for line in lines)
        return "\n".join(out) + "\n"


def run_plan(cfg: MasterConfig, registry: Any, *, longest_prompt: int | None = None) -> str:
    """The run plan of a loaded config, as text (what `grpoctl run --dry-run` prints)."""
    return make_plan(cfg, registry, longest_prompt=longest_prompt).render()


def make_plan(cfg: MasterConfig, registry: Any, *, longest_prompt: int | None = None) -> RunPlan:
    grpo, policy = cfg.grpo, cfg.policy
    rows = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    global_batch = policy.train_global_batch_size or rows
    optimizer_steps = rows // global_batch
    tokens = rows * _longest_sequence(cfg)
    epoch_steps, data_line = _epochs(cfg, registry)
    steps = min(grpo.max_num_steps, epoch_steps) if epoch_steps is not None else grpo.max_num_steps
    model = model_size(policy.model_name)
    memory, memory_lines = _memory(cfg, registry, model, longest_prompt)
    sections = (
        ("components", tuple(_components(cfg, registry))),
        ("model", (f"{policy.model_name}: " + (f"{model.params:,} parameters ({model.how})" if model.params is not None
                                               else model.how),)),
        ("per step", (_rows_line(cfg, rows, optimizer_steps, global_batch), _tokens_line(cfg, rows))),
        ("steps", (data_line,)),
        ("validation", (_validation_line(cfg, registry, steps),)),
        ("checkpoints", (_checkpoint_line(cfg, steps, model),)),
        (f"memory (an estimate, {policy.precision})", tuple(memory_lines)),
    )
    return RunPlan(rows_per_step=rows, optimizer_steps_per_step=optimizer_steps, max_tokens_per_step=tokens,
                   steps_requested=grpo.max_num_steps, steps=steps, epoch_steps=epoch_steps, model=model,
                   memory_bytes=memory, sections=sections)


# --- components ------------------------------------------------------------------------------------


def _n(count: int, noun: str, plural: str = "s") -> str:
    return f"{count} {noun}{plural * (count != 1)}"


def _section(cfg: MasterConfig, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), cfg)


def _origin(registry: Any, kind: str, name: str) -> str:
    info = registry.info(kind, name)
    if info is None:
        return "not installed"
    origin = f"{info.dist} {info.version}" if info.version else (info.dist or "?")
    return origin if info.ok else f"{origin} ({info.status}: {info.problem})"


def _selected(cfg: MasterConfig) -> list[tuple[Any, str]]:
    out = []
    for kind in COMPONENT_KINDS:
        chosen = getattr(_section(cfg, kind.section), kind.selector)
        out.extend((kind, name) for name in (chosen if kind.many else [chosen]))
    return out


def _components(cfg: MasterConfig, registry: Any) -> list[str]:
    rows = [(kind.label, name, _origin(registry, kind.name, name)) for kind, name in _selected(cfg)]
    if _needs_teacher(cfg, registry):
        opd = cfg.on_policy_distillation
        rows.append(("teacher", f"{opd.teacher_model}", f"policy backend {opd.teacher_backend}"))
    cluster = cfg.cluster
    if cluster.runtime == "ray":
        where = f"cluster {cluster.address}" if cluster.address else "a local Ray cluster"
        gpus = _n(cluster.gpus_per_node, "GPU") if cluster.gpus_per_node else "CPUs only"
        runtime = (f"{where}, {_n(cluster.num_nodes, 'node')} x {gpus}; workers: "
                   f"{cluster.policy_workers} policy, {cluster.generation_workers} generation, "
                   f"{cluster.env_workers} environment")
    else:
        runtime = f"one process, device {cluster.device}"
    rows.append(("runtime", cluster.runtime, runtime))
    width = max(len(label) for label, _, _ in rows)
    name_width = max(len(name) for _, name, _ in rows)
    return [f"{label:<{width}}  {name:<{name_width}}  {origin}" for label, name, origin in rows]


def _capabilities(registry: Any, kind: str, name: str) -> frozenset:
    info = registry.info(kind, name)
    return info.spec.capabilities if info is not None and info.ok and info.spec is not None else frozenset()


def _needs_teacher(cfg: MasterConfig, registry: Any) -> bool:
    return (Capability.TEACHER_LOGPROBS in _capabilities(registry, "estimator", cfg.grpo.adv_estimator.name)
            and cfg.on_policy_distillation.teacher_model is not None)


# --- per step ---------------------------------------------------------------------------------------


def _rows_line(cfg: MasterConfig, rows: int, optimizer_steps: int, global_batch: int) -> str:
    grpo, policy = cfg.grpo, cfg.policy
    micro = math.ceil(global_batch / policy.train_micro_batch_size)
    micro_rows = min(global_batch, policy.train_micro_batch_size)
    micro_text = (f"{_n(micro, 'micro-batch', 'es')} of {'up to ' * (global_batch % micro_rows != 0)}{micro_rows} "
                  "rows (policy.train_micro_batch_size)")
    for name in ("sequence_packing", "dynamic_batching"):
        block = getattr(policy, name)
        if block.enabled:  # the count depends on the lengths: only the budget is known here
            budget = block.train_mb_tokens or policy.max_total_sequence_length * policy.train_micro_batch_size
            micro_text = f"micro-batches of up to {budget:,} tokens (policy.{name})"
    line = (f"{rows} rows ({grpo.num_prompts_per_step} prompts x {grpo.num_generations_per_prompt} generations); "
            f"{_n(optimizer_steps, 'optimizer step')} of {global_batch} rows"
            + (" (policy.train_global_batch_size)" if policy.train_global_batch_size else "")
            + (", each" if optimizer_steps > 1 else "") + f" in {micro_text}")
    if grpo.use_dynamic_sampling:
        per_batch = int(grpo.num_prompts_per_step * grpo.batch_multiplier) * grpo.num_generations_per_prompt
        line += (f"; dynamic sampling generates {per_batch} rows per batch, up to "
                 f"{grpo.dynamic_sampling_max_gen_batches} batches a step")
    return line


def _prompt_limit(cfg: MasterConfig) -> int:
    policy = cfg.policy
    budget = policy.max_total_sequence_length - policy.generation.max_new_tokens
    return min(cfg.data.max_input_seq_length or budget, budget)


def _longest_sequence(cfg: MasterConfig) -> int:
    return min(cfg.policy.max_total_sequence_length, _prompt_limit(cfg) + cfg.policy.generation.max_new_tokens)


def _tokens_line(cfg: MasterConfig, rows: int) -> str:
    new = cfg.policy.generation.max_new_tokens
    longest = _longest_sequence(cfg)
    return (f"at most {rows * longest:,} tokens ({rows} rows x {longest}: prompts of up to {_prompt_limit(cfg)} "
            f"tokens + up to {new} new ones, policy.max_total_sequence_length={cfg.policy.max_total_sequence_length}"
            f"); at most {rows * new:,} generated")


# --- steps and epochs --------------------------------------------------------------------------------


def count_rows(path: str) -> tuple[int | None, str]:
    """(rows, "") of a local dataset, counted without parsing it; (None, why) when that is not possible here."""
    if path.startswith("hf:"):
        return None, "a hub dataset, counted once it is loaded"
    where = Path(path).expanduser()
    try:
        if where.is_dir():
            import datasets  # torch-free; memory-maps the Arrow files

            ds = datasets.load_from_disk(str(where))
            if isinstance(ds, datasets.DatasetDict):  # as the run reads it: "train", or the only split
                ds = ds["train"] if "train" in ds else next(iter(ds.values()))
            return len(ds), ""
        if where.suffix in (".jsonl", ".json"):
            with open(where, "rb") as f:
                return sum(1 for line in f if line.strip()), ""
        if where.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(where).metadata.num_rows, ""
    except ImportError as exc:
        return None, f"not counted ({exc.name} is not installed)"
    except Exception as exc:  # noqa: BLE001 - a plan reports what it cannot read; the run names the problem
        return None, f"not counted ({type(exc).__name__}: {exc})"
    return None, f"not counted ({where} is not a JSONL, Parquet or save_to_disk dataset)"


def mixture_epoch_steps(sizes: list[int], weights: list[float], per_step: int, epochs: int,
                        max_steps: int) -> int | None:
    """The step after which every dataset of a mixture has had ``epochs`` passes, drawing as the run's
    ``MixturePrompts`` does (the dataset furthest behind its share, ties to the first); None when that is
    after ``max_steps`` or past what is worth simulating."""
    from fractions import Fraction

    shares = [Fraction(w).limit_denominator(10**6) for w in weights]
    scale = math.lcm(*(s.denominator for s in shares))
    units = [int(s * scale) for s in shares]
    total_units = sum(units)
    drawn = [0] * len(sizes)
    limit = min(max_steps * per_step, MAX_SIMULATED_DRAWS)
    for slot in range(1, limit + 1):
        deficits = [slot * u - total_units * d for u, d in zip(units, drawn)]
        drawn[deficits.index(max(deficits))] += 1
        if slot % per_step == 0 and all(d // n >= epochs for d, n in zip(drawn, sizes)):
            return slot // per_step
    return None


def _epochs(cfg: MasterConfig, registry: Any) -> tuple[int | None, str]:
    """(steps the epochs allow, the steps line)."""
    grpo, data = cfg.grpo, cfg.data
    requested = f"{grpo.max_num_steps} steps requested (grpo.max_num_steps)"
    if data.use_multiple_dataloader:
        paths, weights = [d.path for d in data.datasets], [d.weight for d in data.datasets]
    elif data.train_path:
        paths, weights = [data.train_path], [1.0]
    elif Capability.GENERATES_PROMPTS in _capabilities(registry, "environment", cfg.env.name):
        return None, f"{requested}; the environment {cfg.env.name} makes the prompts, so no epoch limit"
    else:
        return None, f"{requested}; no data.train_path, and {cfg.env.name} makes no prompts: the run needs one"
    counts = [count_rows(p) for p in paths]
    missing = [f"{p}: {why}" for p, (n, why) in zip(paths, counts) if n is None]
    if missing:
        return None, f"{requested}, bounded by grpo.max_num_epochs={grpo.max_num_epochs}; " + "; ".join(missing)
    sizes = [n for n, _ in counts]
    if sum(sizes) < grpo.num_prompts_per_step:  # the run refuses to start (data.prompt_sources)
        return None, (f"{requested}, but the data holds {sum(sizes)} prompts, fewer than the "
                      f"grpo.num_prompts_per_step={grpo.num_prompts_per_step} every step draws: the run stops at start")
    per_step = int(grpo.num_prompts_per_step * grpo.batch_multiplier) if grpo.use_dynamic_sampling \
        else grpo.num_prompts_per_step
    if len(sizes) == 1:
        allowed: int | None = math.ceil(grpo.max_num_epochs * sizes[0] / per_step)
        of = f"{sizes[0]} prompts"
    else:
        allowed = mixture_epoch_steps(sizes, weights, per_step, grpo.max_num_epochs, grpo.max_num_steps)
        of = f"the mixture of {' + '.join(map(str, sizes))} prompts"
    if data.filter_long_prompts:
        of += " (before data.filter_long_prompts drops any)"
    epochs = f"{grpo.max_num_epochs} epoch{'s' * (grpo.max_num_epochs > 1)} of {of}"
    at_most = "at most " if grpo.use_dynamic_sampling else ""  # a step may draw several batches
    if allowed is None or allowed >= grpo.max_num_steps:
        return allowed, f"{requested}; {epochs} allow{'s' * (grpo.max_num_epochs == 1)} them"
    needed = math.ceil(grpo.max_num_steps * per_step / min(sizes)) if len(sizes) == 1 else None
    fix = f"; grpo.max_num_epochs={needed} trains all {grpo.max_num_steps}" if needed else \
        "; raise grpo.max_num_epochs to train them all"
    return allowed, (f"{grpo.max_num_steps} steps requested, {at_most}{allowed} possible with {epochs} "
                     f"(grpo.max_num_epochs={grpo.max_num_epochs}){fix}")


# --- validation and checkpoints ----------------------------------------------------------------------


def _validation_line(cfg: MasterConfig, registry: Any, steps: int) -> str:
    grpo, data = cfg.grpo, cfg.data
    if data.validation_path:
        size, why = count_rows(data.validation_path)
        prompts = min(size, grpo.max_val_samples) if size is not None else grpo.max_val_samples
        source = f"the first {prompts} rows of {data.validation_path}" + (f" ({why})" if why else "")
    elif Capability.GENERATES_PROMPTS in _capabilities(registry, "environment", cfg.env.name):
        source = f"{grpo.max_val_samples} prompts from the environment {cfg.env.name}"
    else:
        return "none (no data.validation_path, and the environment makes no prompts)"
    when = []
    periodic = [s for s in range(grpo.val_period, steps + 1, grpo.val_period) if s >= grpo.val_start_at] \
        if grpo.val_period else []
    if periodic:
        start = f" from step {periodic[0]}" if periodic[0] != grpo.val_period else ""
        when.append(f"every {grpo.val_period} steps{start} (grpo.val_period)")
    if grpo.val_at_start:
        when.append("before the first step")
    if grpo.val_at_end:
        when.append("after the last")
    if not when:
        return "none (grpo.val_period=0, val_at_start and val_at_end false)"
    count = len(periodic) + grpo.val_at_start + (grpo.val_at_end and steps not in periodic)
    samples = grpo.val_num_generations_per_prompt
    return f"{' and '.join(when)}: {_n(count, 'validation')} of {source}, {_n(samples, 'sample')} each"


def _checkpoint_line(cfg: MasterConfig, steps: int, model: ModelSize) -> str:
    ckpt = cfg.checkpointing
    if not ckpt.enabled:
        return "none (checkpointing.enabled=false): the run cannot be resumed"
    saves = steps // ckpt.save_period + (steps % ckpt.save_period != 0)
    where = ckpt.checkpoint_dir or "<run dir>/checkpoints"
    keep = (f"keeps the {ckpt.keep_top_k} best by {ckpt.metric_name or 'step'} and the latest"
            if ckpt.keep_top_k is not None else "keeps all")
    line = (f"every {ckpt.save_period} steps (checkpointing.save_period) and at the end: {_n(saves, 'save')} into "
            f"{where}; {keep}")
    if cfg.policy.lora.enabled:
        line += "; each the LoRA adapters (policy.lora) and their optimizer state only, not the model"
    elif model.params is not None:
        size = model.params * (DTYPE_BYTES[cfg.policy.precision] + (adam_moment_bytes(cfg) if ckpt.save_optimizer else 0))
        line += f"; each about {human_bytes(size)}" + (" with the optimizer state" if ckpt.save_optimizer else "")
    if ckpt.checkpoint_must_save_by:
        line += f"; saves and stops before {ckpt.checkpoint_must_save_by} (checkpointing.checkpoint_must_save_by)"
    return line


# --- memory ------------------------------------------------------------------------------------------


def _memory(cfg: MasterConfig, registry: Any, model: ModelSize,
            longest_prompt: int | None) -> tuple[dict[str, int], list[str]]:
    teacher, teacher_width = None, 4
    if _needs_teacher(cfg, registry):
        opd = cfg.on_policy_distillation
        teacher = model_size(opd.teacher_model)
        teacher_width = DTYPE_BYTES[opd.teacher_precision or cfg.policy.precision]
    return estimate(cfg, model, teacher=teacher, teacher_width=teacher_width, longest_prompt=longest_prompt)
