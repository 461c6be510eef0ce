"""Every name, path and command written in ``skills/**/*.md`` resolves in this repository.

Why: skills are what engineers and agents read as the truth about the code. A renamed class, a moved file or a
dropped make target must fail CI instead of misleading the next reader. The checker is generic over everything
under ``skills/``; what it checks, per markdown file:

- paths: inline code, link targets and bare prose paths under a top-level folder (``tools/x.py``,
  ``conf/packing/greedy.yaml``) exist relative to the document or the repository root; ``<placeholder>`` and
  ``*`` parts must match something; paths under folders that runs create (``outputs/``, ``.cache/``) are skipped.
- names: inline code shaped like a Python name or dotted path is a Hydra key of ``conf/`` (with the keys a group
  file takes from the dataclass schema its ``defaults`` list extends), imports (dotted paths
  into the repository's packages), or has every part found as a word in the repository's Python sources, conf
  and Makefile; in a call ``f(a, key=1)`` the callee and the keyword names are checked.
- Hydra overrides (``+packing=greedy``, ``data.max_seq_len=2048``): the key is in ``conf/``; a config group's
  option file exists.
- commands: bash-block lines (and inline code) starting with ``python``, ``.venv/bin/python`` or ``make``: the
  script or module exists, make targets are in the Makefile, overrides and path arguments resolve.
- python blocks parse, and their imports import.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from hydra.plugins.config_source import ConfigLoadError
from omegaconf import OmegaConf

import mvp_engine.engine.report_config  # noqa: F401  (registers every schema conf/ extends: engine, kit, report)

REPO_ROOT = Path(__file__).resolve().parents[1]
SKILLS_DIR = REPO_ROOT / "skills"
CONF_DIR = REPO_ROOT / "conf"
THIS_FILE = Path(__file__).resolve()  # left out of the corpus so its fake names cannot satisfy the check
GENERATED_ROOTS = ("outputs", "multirun", "runs", ".cache", ".venv")  # created by runs; absent in a fresh checkout
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "build", "dist", *GENERATED_ROOTS}
PATH_EXTENSIONS = ("py", "yaml", "yml", "md", "json", "jsonl", "toml", "png", "txt", "cfg", "ini", "sh")
PYTHON_COMMANDS = ("python", "python3", ".venv/bin/python", ".venv/bin/python3")
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
PYTHON_LANGS = {"python", "py"}
PLACEHOLDER_VALUES = {"", "...", "???"}
# Dotted names under these roots are config keys, never Python attributes, so they must be keys of conf/ (a stale
# ``train.batch_size`` would otherwise pass the word search). ``model`` and ``attention`` are left out: prose uses
# them for Python objects too (``model.config``).
STRICT_HYDRA_ROOTS = ("data", "demo", "packing", "report", "train")

NAME_RE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
OVERRIDE_RE = re.compile(r"(\+{1,2}|~)?([A-Za-z_][\w.]*)=(\S*)")
CALL_RE = re.compile(r"([A-Za-z_][\w.]*)\(")
KWARG_RE = re.compile(r"[(,]\s*([A-Za-z_]\w*)=")
INTERPOLATION_RE = re.compile(r"\$\{([\w.]+)\}")
PATHISH_RE = re.compile(r"\.{0,2}[\w.<>*~-]*(?:/[\w.<>*-]*)+")
FILENAME_RE = re.compile(r"[\w.-]+\.(?:" + "|".join(PATH_EXTENSIONS) + ")")
FENCE_RE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
CODE_SPAN_RE = re.compile(r"(`+)(.+?)\1", re.S)
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Ref:
    """One thing a document claims exists: ``kind`` is path, filename, name, override, command, import or syntax."""

    kind: str
    text: str
    line: int


# --- what the repository holds -------------------------------------------------------------------------------


@dataclass
class RepoIndex:
    """Everything a reference can resolve against, gathered once."""

    root: Path
    top_dirs: set[str]
    packages: set[str]
    words: set[str]
    corpus: str
    basenames: set[str]
    hydra_keys: set[str]
    groups: dict[str, set[str]]
    make_targets: set[str]


def _walk(root: Path):
    """Files of the repository, without VCS, caches and run outputs."""
    for path in sorted(root.iterdir()):
        if path.is_dir():
            if path.name not in SKIP_DIRS and not path.name.startswith(".") and not path.name.endswith(".egg-info"):
                yield from _walk(path)
        elif path.is_file():
            yield path


def _flat_keys(node, prefix: str) -> set[str]:
    keys = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "defaults" and not prefix:
                continue
            full = f"{prefix}.{key}" if prefix else str(key)
            keys.add(full)
            keys |= _flat_keys(value, full)
    return keys


def schema_keys(group: str, node: dict, prefix: str) -> set[str]:
    """The keys a group file takes from the ConfigStore schemas its ``defaults`` list extends (``train_schema``:
    the dataclass holds every key the file does not write)."""
    keys = set()
    for entry in node.get("defaults", []) if group else []:
        if isinstance(entry, str) and entry != "_self_":
            try:
                stored = ConfigStore.instance().load(f"{group}/{entry}.yaml")
            except ConfigLoadError:
                continue
            keys |= _flat_keys(OmegaConf.to_container(stored.node), prefix)
    return keys


def hydra_keys_and_groups(conf_dir: Path) -> tuple[set[str], dict[str, set[str]]]:
    """Dotted keys of every primary config and group option under ``conf_dir``, and each group's options."""
    keys: set[str] = set()
    groups: dict[str, set[str]] = {}
    for path in sorted(conf_dir.rglob("*.yaml")):
        rel = path.relative_to(conf_dir)
        group = "/".join(rel.parts[:-1])
        text = path.read_text()
        node = OmegaConf.to_container(OmegaConf.load(path)) or {}
        prefix = "" if not group or "@package _global_" in text else group.replace("/", ".")
        if group:
            groups.setdefault(group, set()).add(path.stem)
        if prefix:
            keys.add(prefix)
        keys |= (_flat_keys(node, prefix) | schema_keys(group, node, prefix)) - {"defaults"}
    return keys, groups


def make_targets(makefile: Path) -> set[str]:
    if not makefile.is_file():
        return set()
    targets = set()
    for line in makefile.read_text().splitlines():
        match = re.match(r"^([\w.$()/-]+(?:\s+[\w.$()/-]+)*)\s*:(?!=)", line)
        if match and not line.startswith("\t"):
            targets |= set(match.group(1).split())
        if line.startswith(".PHONY:"):
            targets |= set(line.split(":", 1)[1].split())
    return targets


def build_index(root: Path = REPO_ROOT, exclude: tuple[Path, ...] = (THIS_FILE,)) -> RepoIndex:
    files = [p for p in _walk(root) if p.resolve() not in exclude]
    corpus_files = [p for p in files if p.suffix == ".py" or p.name in ("Makefile", "pyproject.toml")
                    or (p.suffix in (".yaml", ".yml") and (root / "conf") in p.parents)]
    corpus = "\n".join(p.read_text(errors="replace") for p in corpus_files)
    top_dirs = {p.name for p in root.iterdir() if p.is_dir() and p.name not in SKIP_DIRS and not p.name.startswith(".")}
    packages = {d for d in top_dirs if any((root / d).rglob("*.py"))}
    keys, groups = hydra_keys_and_groups(root / "conf")
    return RepoIndex(root=root, top_dirs=top_dirs, packages=packages, words=set(re.findall(r"[A-Za-z_]\w*", corpus)),
                     corpus=corpus, basenames={p.name for p in files}, hydra_keys=keys, groups=groups,
                     make_targets=make_targets(root / "Makefile"))


@functools.lru_cache(maxsize=1)
def repo_index() -> RepoIndex:
    return build_index()


# --- what a document claims ----------------------------------------------------------------------------------


def split_blocks(markdown: str) -> list[tuple[str | None, str, int]]:
    """(language or None for prose, text, first line number) for prose runs and fenced blocks."""
    blocks: list[tuple[str | None, str, int]] = []
    lines = markdown.splitlines()
    current: list[str] = []
    start, lang, fence = 1, None, None
    for number, line in enumerate(lines, 1):
        match = FENCE_RE.match(line)
        if fence is None and match:
            blocks.append((None, "\n".join(current), start))
            current, start, fence, lang = [], number + 1, match.group(1), match.group(2).lower()
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            blocks.append((lang, "\n".join(current), start))
            current, start, fence, lang = [], number + 1, None, None
        else:
            current.append(line)
    blocks.append((lang if fence else None, "\n".join(current), start))
    return [b for b in blocks if b[1].strip()]


def is_command(text: str) -> bool:
    words = text.split()
    while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):
        words = words[1:]
    return bool(words) and (words[0] in PYTHON_COMMANDS or words[0] == "make") and len(words) > 1


def looks_like_path(text: str, index: RepoIndex, doc_dir: Path) -> bool:
    if not PATHISH_RE.fullmatch(text) or "/" not in text:
        return False
    first = text.split("/")[0]
    known = index.top_dirs | set(GENERATED_ROOTS) | {".", ".."}
    return first in known or (doc_dir / first).exists() or bool(FILENAME_RE.fullmatch(text.rsplit("/", 1)[-1]))


def classify_span(span: str, line: int, index: RepoIndex, doc_dir: Path) -> list[Ref]:
    """What an inline code span claims, if anything checkable."""
    text = " ".join(span.split())
    if not text:
        return []
    if is_command(text):
        return [Ref("command", text, line)]
    call = CALL_RE.match(text)
    if call and text.endswith(")") or call and ")." in text:
        return [Ref("name", call.group(1), line)] + [Ref("name", k, line) for k in KWARG_RE.findall(text)]
    if " " in text:
        return []
    interpolation = INTERPOLATION_RE.fullmatch(text)
    if interpolation:
        return [Ref("override", f"{interpolation.group(1)}=...", line)]
    override = OVERRIDE_RE.fullmatch(text)
    if override:
        prefix, key, _ = override.groups()
        if prefix or "." in key or key in index.groups:
            return [Ref("override", text, line)]
        return [Ref("name", key, line)]
    if looks_like_path(text, index, doc_dir):
        return [Ref("path", text, line)]
    if FILENAME_RE.fullmatch(text):
        return [Ref("filename", text, line)]
    name = text.removesuffix("()")
    if NAME_RE.fullmatch(name):
        return [Ref("name", name, line)]
    return []


def prose_refs(text: str, start: int, index: RepoIndex, doc_dir: Path) -> list[Ref]:
    refs = []

    def line_of(offset: int) -> int:
        return start + text.count("\n", 0, offset)

    for match in CODE_SPAN_RE.finditer(text):
        refs += classify_span(match.group(2), line_of(match.start()), index, doc_dir)
    plain = CODE_SPAN_RE.sub(lambda m: " " * len(m.group(0)), text)
    for match in LINK_RE.finditer(plain):
        target = match.group(1).split("#")[0]
        if target and not re.match(r"^[a-z]+:", target):
            refs.append(Ref("path", target, line_of(match.start())))
    plain = LINK_RE.sub(lambda m: " " * len(m.group(0)), plain)
    roots = "|".join(re.escape(d) for d in sorted(index.top_dirs))
    if roots:
        for match in re.finditer(r"(?<![\w./-])((?:" + roots + r")/[\w.*<>/-]*[\w*>/])", plain):
            refs.append(Ref("path", match.group(1), line_of(match.start())))
    return refs


def shell_refs(text: str, start: int) -> list[Ref]:
    """Commands of a shell block; continuation lines are joined, prompts and comments dropped."""
    refs, pending, first = [], "", start
    for number, raw in enumerate(text.splitlines(), start):
        line = raw.strip()
        if not pending:
            first = number
            line = line.removeprefix("$ ")
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        command, pending = (pending + line).strip(), ""
        if command and not command.startswith("#") and is_command(command):
            refs.append(Ref("command", command, first))
    return refs


def python_refs(text: str, start: int) -> list[Ref]:
    try:
        tree = ast.parse(text)
    except SyntaxError as err:
        return [Ref("syntax", str(err), start + (err.lineno or 1) - 1)]
    refs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            refs += [Ref("import", f"{node.module}:{alias.name}", start + node.lineno - 1) for alias in node.names]
        elif isinstance(node, ast.Import):
            refs += [Ref("import", f"{alias.name}:", start + node.lineno - 1) for alias in node.names]
    return refs


def extract_references(markdown: str, doc: Path, index: RepoIndex) -> list[Ref]:
    refs = []
    for lang, text, start in split_blocks(markdown):
        if lang is None:
            refs += prose_refs(text, start, index, doc.parent)
        elif lang in SHELL_LANGS:
            refs += shell_refs(text, start)
        elif lang in PYTHON_LANGS:
            refs += python_refs(text, start)
    return refs


# --- does it resolve? ----------------------------------------------------------------------------------------


def check_path(text: str, index: RepoIndex, doc_dir: Path | None = None) -> str | None:
    path = text.split("::")[0].split("#")[0]
    if not path or path.startswith("/"):
        return None  # absolute paths are examples of the user's own data
    if path.removeprefix("./").split("/")[0] in GENERATED_ROOTS:
        return None
    pattern = re.sub(r"<[^>]*>", "*", path)
    for base in [b for b in (doc_dir, index.root) if b is not None]:
        if "*" in pattern:
            if any(base.glob(pattern.rstrip("/"))):
                return None
        elif (base / path).exists():
            return None
    return "no such file or directory"


def resolve_dotted(name: str) -> bool:
    """Import the longest module prefix of ``name`` and walk the rest as attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def check_name(name: str, index: RepoIndex) -> str | None:
    if name in index.hydra_keys or name in index.groups:
        return None
    parts = name.split(".")
    if parts[0] in STRICT_HYDRA_ROOTS and len(parts) > 1:
        return "not a Hydra key in conf/"
    if parts[0] in index.packages and len(parts) > 1:
        return None if resolve_dotted(name) else "does not import"
    missing = [part for part in parts if part not in index.words]
    return f"not found in the Python sources or conf: {missing}" if missing else None


def check_override(text: str, index: RepoIndex) -> str | None:
    match = OVERRIDE_RE.fullmatch(text)
    if not match:
        return "not a Hydra override"
    _, key, value = match.groups()
    if key.startswith("hydra."):
        return None
    group = key.replace(".", "/")
    if group in index.groups:
        if value in PLACEHOLDER_VALUES or "<" in value or value in index.groups[group]:
            return None
        return f"conf/{group}/{value}.yaml does not exist"
    return None if key in index.hydra_keys else f"Hydra key {key!r} is not in conf/"


def check_module(module: str, index: RepoIndex) -> str | None:
    base = index.root / module.replace(".", "/")
    if base.with_suffix(".py").is_file() or (base / "__main__.py").is_file():
        return None
    if module.split(".")[0] in index.top_dirs:
        return f"module {module} has no file in the repository"
    return None if importlib.util.find_spec(module) is not None else f"module {module} is not installed"


def check_command(text: str, index: RepoIndex) -> str | None:
    try:
        words = shlex.split(text, comments=True)
    except ValueError as err:
        return f"cannot parse: {err}"
    while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):
        words = words[1:]
    if words[0] == "make":
        missing = [w for w in words[1:] if not w.startswith("-") and "=" not in w and w not in index.make_targets]
        return f"make target(s) {missing} not in the Makefile" if missing else None
    rest = words[1:]
    if rest[:1] == ["-c"]:
        return None
    if rest[:1] == ["-m"]:
        if len(rest) < 2:
            return "python -m without a module"
        problem, args = check_module(rest[1], index), rest[2:]
    else:
        problem = None if check_path(rest[0], index) is None else f"script {rest[0]} does not exist"
        args = rest[1:]
    return problem or next(filter(None, (check_argument(arg, index) for arg in args)), None)


def check_argument(arg: str, index: RepoIndex) -> str | None:
    """A command argument: Hydra overrides and repository paths must resolve; flags and values pass."""
    if arg.startswith("-"):
        return None
    if OVERRIDE_RE.fullmatch(arg):
        problem = check_override(arg, index)
        return problem and f"{arg}: {problem}"
    if "/" in arg or FILENAME_RE.fullmatch(arg.split("::")[0]):
        return check_path(arg, index) and f"argument {arg} does not exist"
    return None


def check_import(spec: str) -> str | None:
    module, name = spec.split(":")
    try:
        imported = importlib.import_module(module)
    except ImportError as err:
        return f"cannot import {module}: {err}"
    if name and name != "*" and not hasattr(imported, name):
        if importlib.util.find_spec(f"{module}.{name}") is None:
            return f"{module} has no {name}"
    return None


def check_reference(ref: Ref, index: RepoIndex, doc_dir: Path) -> str | None:
    if ref.kind == "path":
        return check_path(ref.text, index, doc_dir)
    if ref.kind == "filename":
        found = ref.text in index.basenames or ref.text in index.corpus
        return None if found else "no file of that name and not named in the sources"
    if ref.kind == "name":
        return check_name(ref.text, index)
    if ref.kind == "override":
        return check_override(ref.text, index)
    if ref.kind == "command":
        return check_command(ref.text, index)
    if ref.kind == "import":
        return check_import(ref.text)
    return ref.text  # syntax: the message is the problem


def find_problems(markdown: str, doc: Path, index: RepoIndex | None = None) -> list[str]:
    """One line per reference of ``markdown`` (read as if it were ``doc``) that does not resolve."""
    index = index or repo_index()
    label = doc.relative_to(index.root) if doc.is_relative_to(index.root) else doc
    problems = []
    for ref in extract_references(markdown, doc, index):
        problem = check_reference(ref, index, doc.parent)
        if problem:
            problems.append(f"{label}:{ref.line}: {ref.kind} `{ref.text}`: {problem}")
    return problems


# --- tests ---------------------------------------------------------------------------------------------------


def skill_docs() -> list[Path]:
    return sorted(SKILLS_DIR.rglob("*.md")) if SKILLS_DIR.is_dir() else []


def test_skills_folder_has_docs():
    assert skill_docs(), "skills/ holds no markdown"


@pytest.mark.parametrize("doc", skill_docs(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_reference_in_a_skill_doc_resolves(doc):
    problems = find_problems(doc.read_text(), doc)
    assert not problems, "unresolved references:\n" + "\n".join(problems)


def test_checker_fails_on_what_does_not_exist():
    """Each broken reference below must be reported, so the check above can fail."""
    bogus = "MLLM" + "Nowhere" + "Spec"  # built here so no source file (not even this one) spells it
    markdown = "\n".join([
        "# fake",
        f"Plan with `{bogus}` and `MLLMPack.{bogus.lower()}()`, configured in `tools/no_such_tool.py`.",
        "See [the rules](references/no_such_file.md) and conf/packing/zigzag.yaml.",
        "Set `+packing=zigzag` or `data.no_such_key=3` or `train.batch_size`;",
        "import `mvp_engine.kit.mllm.data.NoSuchThing`.",
        "```bash",
        "python -m recipes.no_such_recipe.train +packing=greedy",
        ".venv/bin/python tools/no_such_tool.py",
        "make no-such-target",
        "```",
        "```python",
        f"from mvp_engine.kit.mllm.data import {bogus}",
        "```",
    ])
    problems = find_problems(markdown, SKILLS_DIR / "fake" / "SKILL.md")
    expected = [f"`{bogus}`", f"`MLLMPack.{bogus.lower()}`", "`tools/no_such_tool.py`", "references/no_such_file.md",
                "conf/packing/zigzag.yaml", "`+packing=zigzag`", "`data.no_such_key=3`", "`train.batch_size`",
                "NoSuchThing",
                "recipes.no_such_recipe.train", "python tools/no_such_tool.py", "no-such-target",
                f"mvp_engine.kit.mllm.data:{bogus}"]
    for needle in expected:
        assert any(needle in p for p in problems), f"{needle} not reported in:\n" + "\n".join(problems)
    assert len(problems) == len(expected), "\n".join(problems)


def test_checker_accepts_what_exists():
    markdown = "\n".join([
        "Use `MLLMPackingSpec` (`max_seq_len`, `buffer_size`) and `MLLMPack.to_model_inputs()` from",
        "`mvp_engine.kit.mllm.data.MLLMPack`; call `MLLMCollator(pad_token_id, pad_to_multiple_of=8)`.",
        "Keys `data.max_seq_len`, `${data.seed}`, `+packing=greedy`, `attention=eager`, `conf/packing/*.yaml`,",
        "`recipes/<name>/train.py`, `outputs/<model>/<time>/`, `summary.json`; values like `-100` or `(4, B, L)`.",
        "```bash",
        "$ .venv/bin/python -m recipes.qwen2_vl.train +packing=bfd data.max_seq_len=2048 \\",
        "    train.micro_batch_size=2   # a comment",
        "WORLD_SIZE=2 python tools/bench_packing.py --samples 1000",
        "python -m pytest -q tests/test_specs_and_datasets.py::test_custom_assembler_end_to_end",
        "make test",
        "```",
        "```python",
        "from mvp_engine.kit.mllm.data import MLLMPackingAssembler",
        "```",
    ])
    assert find_problems(markdown, SKILLS_DIR / "fake" / "SKILL.md") == []
