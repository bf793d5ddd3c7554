"""Datasets as LLaMA-Factory and ms-swift users keep them: a ``dataset_info.json`` dir
(``data.dataset_dir``), alpaca rows, ms-swift ``query``/``response`` rows and Qwen's inline
content parts. Each form's sample equals the same sample written in the LLaVA form; what
cannot be read is named (file, row, key) at validation and by ``disagg data check``."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import ray
import test_data_fakes
import torch
from test_data_fakes import families, make_tokenizer_dir, write_image, write_jsonl

from disagg.config.schema import Config
from disagg.data import DataError
from disagg.data.dataset_info import resolve
from disagg.data.formats import detect_format
from disagg.data.index import index_dataset
from disagg.data.preprocess import preprocess_record
from disagg.data.records import Record, parse_sample

ray.cloudpickle.register_pickle_by_value(test_data_fakes)  # Ray workers cannot import test modules


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lf")
    make_tokenizer_dir(root)
    write_image(root / "a.png", 8, 8)
    write_image(root / "wide.png", 16, 8, (0, 0, 255))
    return root


def llava(turns: list[tuple[str, str]], images: list[str]) -> dict:
    """The LLaVA twin: ``turns`` of (role, text with <image> markers)."""
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    row: dict = {"conversations": [{"from": names[r], "value": t} for r, t in turns]}
    if images:
        row["image"] = images
    return row


def inputs(root: Path, item: dict, fmt: str, columns=None, media_root: Path | None = None) -> dict:
    fams = families(root / "tok")
    messages, media = parse_sample(item, "t:1", media_root or root, {"image"}, fmt, "", columns)
    return preprocess_record(Record(0, 0, "t:1", messages, media), fams, fams["llm"].tokenizer()).inputs


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for m in a:
        assert a[m].keys() == b[m].keys(), m
        for k in a[m]:
            assert torch.equal(a[m][k], b[m][k]), (m, k)


# (row of the form, its format, the LLaVA twin's turns and images)
MULTI = [("user", "Hi."), ("assistant", "Hello."), ("user", "<image>What is it?"), ("assistant", "A square.")]
FORMS = {
    "alpaca": (
        {
            "instruction": "<image>Describe.",
            "input": "Be brief.",
            "output": "A red square.",
            "images": ["a.png"],
            "system": "You see shapes.",
            "history": [["Hi.", "Hello."]],
        },
        "alpaca",
        [("system", "You see shapes."), ("user", "Hi."), ("assistant", "Hello.")]
        + [("user", "<image>Describe.\nBe brief."), ("assistant", "A red square.")],
        ["a.png"],
    ),
    "alpaca, empty input": (
        {"instruction": "<image>Describe.", "input": "", "output": "A red square.", "images": ["a.png"]},
        "alpaca",
        [("user", "<image>Describe."), ("assistant", "A red square.")],
        ["a.png"],
    ),
    "ms-swift query/response, image in history": (
        {
            "query": "And this one?<image>",
            "response": "A blue one.",
            "history": [["<image>What is it?", "A red square."]],
            "images": ["a.png", "wide.png"],
            "system": "You see shapes.",
        },
        "query_response",
        [("system", "You see shapes."), ("user", "<image>What is it?"), ("assistant", "A red square.")]
        + [("user", "And this one?<image>"), ("assistant", "A blue one.")],
        ["a.png", "wide.png"],
    ),
    "ms-swift query/response, no marker": (
        # ms-swift puts a missing <image> at the start of the first user turn
        {"query": "What is it?", "response": "A red square.", "images": ["a.png"], "history": []},
        "query_response",
        [("user", "<image>What is it?"), ("assistant", "A red square.")],
        ["a.png"],
    ),
    "qwen inline parts, image in a later turn": (
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
                {
                    "role": "user",
                    "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "What is it?"}],
                },
                {"role": "assistant", "content": "A square."},
            ]
        },
        "sharegpt",
        MULTI,
        ["a.png"],
    ),
}


@pytest.mark.parametrize("form", FORMS)
def test_each_form_equals_its_llava_twin(root, form):
    row, fmt, turns, images = FORMS[form]
    assert detect_format([("t:1", row)])[0] == fmt  # data.format: auto reads it as its form
    assert_same(inputs(root, row, fmt), inputs(root, llava(turns, images), "llava"))


def test_qwen_inline_file_urls_data_urls_and_image_url_parts(root):
    """``file://`` paths, base64 ``data:`` URLs (the file's bytes) and OpenAI's ``image_url``
    parts name the same image; a Qwen row is no longer read as LLaVA with a missing file."""
    want = inputs(root, llava([("user", "<image>What?"), ("assistant", "A.")], ["a.png"]), "llava")
    b64 = base64.b64encode((root / "a.png").read_bytes()).decode()
    for part in (
        {"type": "image", "image": f"file://{root / 'a.png'}"},
        {"type": "image", "image": f"data:image/png;base64,{b64}"},
        {"type": "image_url", "image_url": {"url": "a.png"}},
    ):
        row = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}]}
        row["messages"].append({"role": "assistant", "content": "A."})
        assert_same(inputs(root, row, "llava"), want)  # inline media read alike in either chat format
    p = write_jsonl(root / "qwen.jsonl", [row])
    assert index_dataset(p, root).format == "sharegpt"


@pytest.mark.parametrize(
    "row, problem",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "https://x/a.png"}]}]},
            "turn 0: media URL 'https://x/a.png' is not downloaded",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "image"}]},
                    {"role": "assistant", "content": "A."},
                ],
                "images": ["a.png"],
            },
            "some image parts name their file and others do not",
        ),
        (
            {"instruction": "<image>Hi.", "output": "A.", "image": "a.png"},
            "alpaca rows list their image files under 'images', not 'image'",
        ),
        ({"instruction": "Hi.", "input": "", "output": None}, "'output' must be a string, got nothing"),
        (
            {"query": "Hi.", "response": "A.", "history": [["q"]]},
            "'history'[0] must be a [prompt, answer] pair",
        ),
    ],
)
def test_unreadable_rows_name_the_key(root, row, problem):
    fmt = detect_format([("t:1", row)])[0]
    with pytest.raises(DataError, match=r"^t:1: .*" + problem.replace("[", r"\[").replace("]", r"\]")):
        parse_sample(row, "t:1", root, {"image"}, fmt)


# LLaMA-Factory's own demo entry (data/dataset_info.json: mllm_demo) and an alpaca one
INFO = {
    "mllm_demo": {
        "file_name": "mllm_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
        },
    },
    "alpaca_mm": {
        "file_name": "alpaca_mm.jsonl",
        "columns": {"prompt": "instruction", "query": "input", "response": "output", "images": "images"}
        | {"system": "system", "history": "history"},
    },
    "no_query": {"file_name": "alpaca_mm.jsonl", "columns": {"prompt": "instruction", "response": "output"}},
    # no tags: LLaMA-Factory's from/value, human/gpt and a first 'system' turn
    "conv_default_tags": {
        "file_name": "conv.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "images": "images"},
    },
}
MLLM_DEMO_ROW = {
    "messages": [
        {"content": "<image>Who are they?", "role": "user"},
        {"content": "Two squares.", "role": "assistant"},
        {"content": "What are they doing?<image>", "role": "user"},
        {"content": "Standing still.", "role": "assistant"},
    ],
    "images": ["a.png", "wide.png"],
}
ALPACA_ROW = FORMS["alpaca"][0]


@pytest.fixture(scope="module")
def lf_dir(root):
    d = root / "lf_data"
    write_image(d / "a.png", 8, 8)
    write_image(d / "wide.png", 16, 8, (0, 0, 255))
    (d / "dataset_info.json").write_text(json.dumps(INFO, indent=2))
    (d / "mllm_demo.json").write_text(json.dumps([MLLM_DEMO_ROW], indent=2))
    write_jsonl(d / "alpaca_mm.jsonl", [ALPACA_ROW])
    conv = {"conversations": [{"from": "system", "value": "Sys."}, *llava(MULTI, [])["conversations"]]}
    (d / "conv.json").write_text(json.dumps([{**conv, "images": ["a.png"]}]))
    return d


@pytest.mark.parametrize(
    "name, turns, images",
    [
        ("mllm_demo", [(m["role"], m["content"]) for m in MLLM_DEMO_ROW["messages"]], ["a.png", "wide.png"]),
        ("alpaca_mm", FORMS["alpaca"][2], ["a.png"]),
        # LLaMA-Factory reads only the columns an entry names (all of them: its defaults without
        # 'columns', which name no system, history or images column)
        ("no_query", [("user", "<image>Describe."), ("assistant", "A red square.")], None),
        ("conv_default_tags", [("system", "Sys."), *MULTI], ["a.png"]),
    ],
)
def test_dataset_info_entries_read_as_llama_factory_reads_them(root, lf_dir, name, turns, images):
    path, columns = resolve(lf_dir, name)
    row = json.loads(Path(path).read_text()) if path.endswith(".json") else ALPACA_ROW
    row = row[0] if isinstance(row, list) else row
    if images is None:  # no images column: the <image> marker's file is not read
        with pytest.raises(
            DataError,
            match=r"1 <image> placeholder\(s\) .* 0 image file\(s\) in .*'no_query'.* no 'images' column",
        ):
            parse_sample(row, "t:1", lf_dir, {"image"}, columns.formatting, "", columns)
        row = {**row, "instruction": "Describe."}
        turns = [("user", "Describe."), ("assistant", "A red square.")]
        images = []
    assert_same(
        inputs(root, row, columns.formatting, columns, lf_dir),
        inputs(root, llava(turns, images), "llava", None, lf_dir),
    )


@pytest.mark.parametrize(
    "turns, problem",
    [
        (
            [("system", "S."), ("user", "Q."), ("assistant", "A.")],
            "turn 0 has role: 'system', but turn 0 must be the user's",
        ),
        (
            [("user", "Q."), ("user", "Q2."), ("assistant", "A.")],
            "turn 1 has role: 'user', but turn 1 must be the assistant's",
        ),
        ([("user", "Q."), ("assistant", "A."), ("user", "Q2.")], "the last turn is the user's"),
    ],
)
def test_dataset_info_turn_order_errors_name_the_tags(root, lf_dir, turns, problem):
    """mllm_demo's tags name no system_tag: as in LLaMA-Factory, a system turn is then not one."""
    _, columns = resolve(lf_dir, "mllm_demo")
    row = {"messages": [{"role": r, "content": t} for r, t in turns]}
    with pytest.raises(DataError, match=problem):
        parse_sample(row, "f.json[3]", lf_dir, {"image"}, "sharegpt", "", columns)


def lf_config(root: Path, lf_dir: Path, train, **data) -> Config:
    return Config(
        model={
            "vision": {"family": "fake_image", "path": str(root / "tok")},
            "llm": {"family": "fake_lm", "path": str(root / "tok")},
        },
        data={"train": train, "dataset_dir": str(lf_dir), "batch_size": 1, "num_workers": 1, "shuffle": False}
        | data,
    )


def test_validation_names_the_entry_and_key(root, lf_dir, tmp_path, disagg_registry):
    from test_data_check import FakesPlugin

    from disagg.config.errors import ConfigError
    from disagg.config.validate import validate
    from disagg.plugins import get_registry, register_plugin

    register_plugin(FakesPlugin(), name="fakes")
    validate(lf_config(root, lf_dir, "mllm_demo", eval="alpaca_mm"), get_registry())
    info = {
        **INFO,
        "hub": {"hf_hub_url": "org/data"},
        "odd": {"file_name": "mllm_demo.json", "formatting": "openai"},
        "wrong_tags": {**INFO["mllm_demo"], "tags": {**INFO["mllm_demo"]["tags"], "content_tag": "value"}},
        "wrong_columns": {**INFO["mllm_demo"], "columns": {"messages": "conversations"}},
    }
    d = tmp_path / "lf"
    d.mkdir()
    (d / "dataset_info.json").write_text(json.dumps(info))
    (d / "mllm_demo.json").write_text(json.dumps([MLLM_DEMO_ROW]))
    entries = [{"path": n} for n in ("mllm_dmeo", "hub", "odd", "wrong_tags", "wrong_columns")]
    with pytest.raises(ConfigError) as exc:
        validate(lf_config(root, d, entries, format="sharegpt"), get_registry())
    text = str(exc.value)
    where = f"{d}/dataset_info.json"
    for want in [
        "data.format: 'sharegpt' is set with data.dataset_dir",
        f"data.train.0.path: {where}: no dataset 'mllm_dmeo'",
        "did you mean 'mllm_demo'?",
        f"data.train.1.path: {where}: hub: 'hf_hub_url' datasets are not read",
        "data.train.2.path: "
        + f"{where}: odd: 'formatting': 'openai' is not read; allowed: alpaca, sharegpt",
        f"data.train.3.path: {d}/mllm_demo.json[0]: turn 0 has no 'value', the entry's content_tag",
        f"data.train.4.path: {d}/mllm_demo.json[0]: the row has no 'conversations'",
    ]:
        assert want in text, (want, text)


def test_data_check_names_file_row_and_key(root, lf_dir, tmp_path, ray_local, disagg_registry):
    """A dataset_info dataset and a plain file beside it (mixed in one data.train): every bad
    row with its file, row and the key it cannot read."""
    from test_data_check import FakesPlugin

    from disagg.cli.main import main
    from disagg.plugins import register_plugin

    register_plugin(FakesPlugin(), name="fakes")
    bad = [
        MLLM_DEMO_ROW,
        {**MLLM_DEMO_ROW, "images": ["a.png"]},  # two markers, one file
        {"messages": [{"role": "user", "content": "Q."}, {"role": "gpt", "content": "A."}]},
        {**MLLM_DEMO_ROW, "images": ["a.png", "gone.png"]},
    ]
    (lf_dir / "mllm_bad.json").write_text(json.dumps(bad))
    info = json.loads((lf_dir / "dataset_info.json").read_text())
    (lf_dir / "dataset_info.json").write_text(
        json.dumps({**info, "bad": {**INFO["mllm_demo"], "file_name": "mllm_bad.json"}})
    )
    swift = write_jsonl(tmp_path / "swift.jsonl", [{"query": "Q.", "response": 3}])
    cfg = lf_config(root, lf_dir, [{"path": "bad"}, {"path": str(swift), "media_root": str(lf_dir)}])
    (tmp_path / "c.yaml").write_text(json.dumps(cfg.model_dump(exclude_defaults=True)))
    out = tmp_path / "r.json"
    assert main(["data", "check", str(tmp_path / "c.yaml"), "--no-progress", "--report", str(out)]) == 1
    report = json.loads(out.read_text())
    assert (report["ok"], report["bad"]) == (1, 4)
    f = lf_dir / "mllm_bad.json"
    assert sorted(report["problems"]) == sorted(
        [
            f"{f}[1]: 2 <image> placeholder(s) in the text but 1 image file(s) in 'images'",
            f"{f}[2]: turn 1 has role: 'gpt', but turn 1 must be the assistant's (role: 'assistant'): "
            "dataset_info.json entry 'bad' (formatting: sharegpt) reads user and assistant turns in turn "
            "(its 'tags' name the role values)",
            f"{f}[3]: missing image file 'gone.png' (looked for {lf_dir / 'gone.png'})",
            f"{swift}:1: 'response' must be a string, got int",
        ]
    )
    assert f"{f}: sharegpt (dataset_info.json entry 'bad' (formatting: sharegpt))" in report["formats"]


def test_docs_examples_read_as_their_form(root):
    """docs/data.md's examples of the forms beyond llava/sharegpt rows: each is detected as the
    form it illustrates and reads as its LLaVA twin."""
    import re

    page = (Path(__file__).resolve().parents[3] / "docs" / "data.md").read_text()
    found = re.findall(r"<!-- data-example: (\w+) -->\n```json\n(.*?)\n```", page, re.S)
    assert [f for f, _ in found] == ["sharegpt", "alpaca", "query_response"]
    write_image(root / "shapes" / "red_square.png", 8, 8)
    for fmt, text in found:
        item = json.loads(text)
        assert detect_format([("docs/data.md", item)])[0] == fmt
        messages, media = parse_sample(item, "docs/data.md", root, {"image"}, fmt)
        assert len(media["image"]) == 1 and messages[-1] == ("assistant", "A red square.")


def test_make_tiny_data_dir_is_a_llama_factory_dir(tmp_path):
    """The demo data's dataset_info.json reads its LLaVA rows through LLaMA-Factory's sharegpt
    defaults (the ``image`` key as the images column): the same turns and files as read as llava."""
    from disagg.data.demo_data import make_demo_data

    files = make_demo_data(tmp_path, train_per_class=1, eval_per_class=1)
    for split in ("train", "eval"):
        path, columns = resolve(tmp_path, f"demo_{split}")
        assert path == str(files[split])
        rows = [json.loads(x) for x in Path(path).read_text().splitlines()]
        for i, row in enumerate(rows):
            lf = parse_sample(row, f"r{i}", tmp_path, {"image"}, "sharegpt", "", columns)
            assert lf == parse_sample(row, f"r{i}", tmp_path, {"image"}, "llava") and lf[1]["image"]
