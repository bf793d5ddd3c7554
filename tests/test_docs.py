"""The README and docs/ say what the code does: every YAML config snippet loads and validates
through the real loader and validator (on what ``disagg make-tiny`` writes), every ``disagg``
command line in a shell block parses with the real CLI parser, every ``nox -s`` names a session
of the noxfile, and every relative link (and its #anchor) resolves.

A YAML snippet with a ``model:`` section is a whole config; any other is a fragment, merged onto
the ``model:`` and ``data:`` of docs/configuration.md's example (the one the fragments are
documented against). The README's real-checkpoint config names a downloaded model and the user's
data; here those paths are links to the tiny dir of the same family and the tiny dataset, so
everything but the weights' size is checked.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.cli.main import build_parser
from disagg.cli.make_tiny import make_tiny
from disagg.config import ConfigError, load_config_and_source
from disagg.config.validate import validate
from disagg.plugins import get_registry

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: paths the README's real-checkpoint run names, and what stands in for each here
STAND_INS = {"models/Qwen2.5-VL-3B-Instruct": "tiny/qwen2_5_vl", "my_data": "tiny/data"}
README_MAX_LINES = 150

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang: tuple[str, ...]) -> list[tuple[str, int, str]]:
    """(page, line, text) of every fenced block in one of ``lang``."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) in lang:
                out.append((page.relative_to(ROOT).as_posix(), text[: m.start()].count("\n") + 1, m.group(2)))
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge(out[key], value) if both else value
    return out


YAML = blocks(("yaml", "yml"))
SHELL = blocks(("bash", "sh", "shell", "console"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cwd holding ``tiny/`` as ``disagg make-tiny tiny --families qwen2_5_vl`` writes it
    (fewer images per class), plus the stand-ins of the real-checkpoint paths."""
    root = tmp_path_factory.mktemp("docs")
    make_tiny(root / "tiny", ["qwen2_5_vl"], train_per_class=1, eval_per_class=1)
    for path, target in STAND_INS.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).symlink_to(root / target, target_is_directory=True)
    return root


def base_config() -> dict[str, Any]:
    """``model:`` and ``data:`` of the first whole config in docs/configuration.md."""
    for page, _, text in YAML:
        doc = yaml.safe_load(text)
        if page == "docs/configuration.md" and "model" in doc:
            return {"model": doc["model"], "data": doc["data"]}
    raise AssertionError("docs/configuration.md has no whole config example")


def test_pages_have_config_snippets():
    assert len(YAML) >= 10, [(p, n) for p, n, _ in YAML]
    assert any(p == "README.md" and "model:" in t for p, _, t in YAML), "README lost its GPU config"


@pytest.mark.parametrize(("page", "line", "text"), YAML, ids=[f"{p}:{n}" for p, n, _ in YAML])
def test_yaml_snippet_validates(page: str, line: int, text: str, workdir: Path, monkeypatch) -> None:
    doc = yaml.safe_load(text)
    assert isinstance(doc, dict), f"{page}:{line}: not a YAML mapping"
    config = doc if "model" in doc else merge(base_config(), doc)
    monkeypatch.chdir(workdir)
    path = workdir / f"{Path(page).stem}-{line}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        cfg, source = load_config_and_source(path)
        validate(cfg, get_registry(), source=source)
    except ConfigError as exc:
        raise AssertionError(f"{page}:{line}: the snippet does not validate:\n{exc}\n{text}") from None


def shell_commands() -> list[tuple[str, int, list[str]]]:
    """Each shell line (continuations joined) as tokens, comments dropped."""
    out = []
    for page, start, text in SHELL:
        for offset, line in enumerate(text.replace("\\\n", " ").splitlines()):
            tokens = shlex.split(line, comments=True)
            if tokens:
                out.append((page, start + 1 + offset, tokens))
    return out


def disagg_argv(tokens: list[str]) -> list[str] | None:
    """The arguments after ``disagg`` (also after ``kubectl exec ... --`` or ``ray job submit ... --``),
    up to a shell operator."""
    if "disagg" not in tokens:
        return None
    argv = tokens[tokens.index("disagg") + 1 :]
    for i, tok in enumerate(argv):
        if tok in ("&&", "||", ";", "|"):
            return argv[:i]
    return argv


COMMANDS = [(p, n, a) for p, n, t in shell_commands() if (a := disagg_argv(t)) is not None]


def test_pages_have_disagg_commands():
    names = {a[0] for _, _, a in COMMANDS if a}
    assert {"train", "make-tiny", "data", "export", "bench", "plan", "plot"} <= names, names


@pytest.mark.parametrize(("page", "line", "argv"), COMMANDS, ids=[f"{p}:{n}" for p, n, _ in COMMANDS])
def test_disagg_command_parses(page: str, line: int, argv: list[str], capsys) -> None:
    assert "--help" not in argv and "-h" not in argv, f"{page}:{line}: show a command, not its help"
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"{page}:{line}: disagg {shlex.join(argv)}: {capsys.readouterr().err}") from None
    assert callable(args._run)


def test_nox_sessions_exist():
    noxfile = (ROOT / "noxfile.py").read_text()
    sessions = set(re.findall(r"@nox\.session[^\n]*\n(?:@[^\n]*\n)*def (\w+)\(", noxfile))
    used = [(p, n, t[t.index("-s") + 1]) for p, n, t in shell_commands() if t[0] == "nox" and "-s" in t]
    assert used, "no nox -s line in the pages"
    missing = [f"{p}:{n}: nox -s {s}" for p, n, s in used if s not in sessions]
    assert missing == [], f"sessions not in noxfile.py ({sorted(sessions)}): {missing}"


def slugs(page: Path) -> set[str]:
    """GitHub's heading anchors of a page (headings inside code blocks excluded)."""
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_relative_links_resolve():
    bad = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                bad.append(f"{where}: {path} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
                bad.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert bad == [], "\n".join(bad)


#: backticked paths that name what a run or the user writes, not files of this repository
RUN_PATHS = ("runs/", "tiny/", "data/", "my_data", "models/", "/shared", "checkpoints/", "<", "OUT", "RUN")


def python_name_exists(name: str) -> bool:
    """``disagg.x.y`` (or a plugin's ``disagg_x.y``): a module, or an attribute of the longest
    importable prefix."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_named_files_and_python_names_exist():
    """Every repository file path and every ``disagg.*`` name the pages put in backticks exists
    (file paths may be given from the repository root or from a package's ``src/``)."""
    roots = [ROOT, *(p / "src" for p in (ROOT / "packages").iterdir())]
    bad = []
    for page in PAGES:
        for token in set(re.findall(r"`([^`\s]+)`", page.read_text())):
            token = re.sub(r"\(.*\)$", "", token.rstrip(",."))
            if re.search(r"/[\w.-]+\.(py|md|yaml|json|toml)$", token) and not token.startswith(RUN_PATHS):
                if not any((r / token).exists() for r in roots):
                    bad.append(f"{page.relative_to(ROOT)}: {token}")
            elif re.fullmatch(r"disagg(_\w+)?(\.\w+)+", token) and not python_name_exists(token):
                bad.append(f"{page.relative_to(ROOT)}: {token}")
    assert bad == [], bad


def test_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "README.md: move detail into docs/"
    unlinked = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert unlinked == [], f"docs pages the README does not link: {unlinked}"


def test_plugin_page_strategy_example_registers(disagg_registry):
    """docs/plugins.md's strategy snippet, as written, is a plugin that registers its strategy
    and rejects an unknown option (the tracker snippet is run by test_eval_config)."""
    import types

    from disagg.plugins import register_plugin

    page = (ROOT / "docs" / "plugins.md").read_text()
    (code,) = [t for lang, t in FENCE.findall(page) if lang == "python" and "class ExampleDDP" in t]
    plugin = types.ModuleType("docs_strategy")
    exec(code, plugin.__dict__)
    reg = register_plugin(plugin, name="docs-strategy")
    cls = reg.strategies["example_ddp"]
    assert cls.options_model(log_every=3).log_every == 3
    with pytest.raises(ValueError, match="nope"):
        cls.options_model(nope=1)
