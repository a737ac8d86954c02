"""The documentation site builds with ``mkdocs build --strict``, and its generated pages are complete.

One strict build in a fresh interpreter (no broken links or anchors, every page in the nav),
which must not import torch: the reference pages are generated from specs, config classes and
the Typer app alone. Then the built HTML is checked against the code it documents: every config
key with its help text, every ``grpoctl`` command with its ``--help``. The quickstart's commands
are the README's first lines, so the two cannot drift apart.
"""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HEAVY = ("torch", "transformers", "ray", "vllm")

BUILD = """
import json, sys
from mkdocs.__main__ import cli
try:
    cli.main(args=sys.argv[1:], prog_name="mkdocs", standalone_mode=True)
    rc = 0
except SystemExit as exc:
    rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
print(json.dumps({{"rc": rc, "heavy": sorted(m for m in {heavy!r} if m in sys.modules)}}))
"""

REQUIRED_COMMANDS = ["run", "config show", "config validate", "config schema", "plugins list", "plugins show", "plugins new",
                     "doctor", "export", "report"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-c", BUILD.format(heavy=HEAVY), "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip(), result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    assert report["heavy"] == [], f"building the docs imported {report['heavy']}"
    return out


def gen_reference():
    sys.path.insert(0, str(DOCS))
    try:
        import gen_reference
    finally:
        sys.path.remove(str(DOCS))
    return gen_reference


def page_text(site: Path, page: str) -> str:
    """The visible text of a built page: tags stripped, entities decoded, whitespace collapsed."""
    raw = (site / page / "index.html").read_text(encoding="utf-8")
    body = raw.split('role="main"', 1)[-1]
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", body)).split())


def plain(text: str) -> str:
    """Help text as it reads once rendered: code spans lose their backticks."""
    return " ".join(text.replace("`", "").split())


def squashed(text: str) -> str:
    """Text without whitespace: a rendered code span gains spaces around it (``wandb sync .``)."""
    return re.sub(r"\s+", "", text)


def test_config_reference_has_every_key_with_its_help(site):
    text = page_text(site, "reference/config")
    assert "grpo.num_prompts_per_step" in text
    assert plain("Prompts drawn per step; the rollout batch is num_prompts_per_step x num_generations_per_prompt "
                 "rows.") in text
    # A built-in plugin block, documented whether or not its extra is installed here.
    assert "policy.generation.vllm.gpu_memory_utilization" in text
    assert "pip install 'grpo-sdk[vllm]'" in text
    ref = gen_reference()
    rows = ref.config_rows(ref.builtin_registry())
    assert len(rows) > 150
    # A plugin block without options says "No options." on the page instead of schema's suffix.
    page = squashed(text)
    missing = [path for path, _, _, help_text in rows
               if path not in text or squashed(plain(help_text.removesuffix(" (no options)"))) not in page]
    assert not missing, f"config keys missing from the config reference, or without their help: {missing}"


def test_config_reference_sections_have_stable_anchors(site):
    raw = (site / "reference/config/index.html").read_text(encoding="utf-8")
    for section in ("grpo", "grpo.reward_scaling", "policy.generation", "policy.generation.vllm",
                    "grpo.adv_estimator.grpo", "env.reverse_digits", "cluster"):
        assert f'id="{section}"' in raw, section


def test_cli_reference_has_every_command(site):
    text = page_text(site, "reference/cli")
    for command in REQUIRED_COMMANDS:
        assert f"Usage: grpoctl {command} " in text, command
    commands = gen_reference().cli_commands()
    assert {path for path, _ in commands} >= {f"grpoctl {c}" for c in REQUIRED_COMMANDS}
    for path, help_text in commands:
        assert " ".join(help_text.split()) in text, f"the --help of {path} is not on the CLI reference page"


def first_code_block(markdown: str) -> tuple[int, list[str]]:
    """(line number of the opening fence, lines inside) of the first fenced block."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("```"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return start, lines[start + 1:end]


def test_quickstart_shows_the_readme_commands():
    readme_start, readme = first_code_block((ROOT / "README.md").read_text(encoding="utf-8"))
    _, quickstart = first_code_block((DOCS / "quickstart.md").read_text(encoding="utf-8"))
    assert readme_start <= 2, "the README should open with its two commands, right under the title"
    assert len(readme) == 2 and "grpoctl run" in readme[0] and "pytest" in readme[1]
    assert quickstart == readme, "docs/quickstart.md must show exactly the README's first two commands"


def test_generated_pages_are_not_committed():
    """The hook generates them at build time; a copy in docs/ would only go stale."""
    assert not (DOCS / "reference").exists()


# A command a page shows, and the extra it needs: the page must say to install it.
EXTRA_COMMANDS = [
    (re.compile(r"grpoctl report"), "report"),
    (re.compile(r"env\.name[=:] ?math\b|^\s*name: math\b", re.MULTILINE), "math"),
    (re.compile(r"cluster\.runtime[=:] ?ray\b"), "ray"),
    (re.compile(r"policy\.lora\.enabled[=:] ?true"), "lora"),
]
CODE = re.compile(r"```\w*\n(.*?)```", re.DOTALL)


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")) + [ROOT / "README.md"], ids=lambda p: p.name)
def test_a_page_that_shows_a_command_needing_an_extra_says_to_install_it(page):
    text = page.read_text()
    code = "\n".join(CODE.findall(text))
    for pattern, extra in EXTRA_COMMANDS:
        if pattern.search(code):
            assert re.search(rf"\[[\w,]*\b{extra}\b[\w,]*\]|extra:? `?{extra}`?", text), \
                f"{page.name} shows a command that needs the {extra!r} extra without saying to install it"
