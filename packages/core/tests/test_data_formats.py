"""Dataset formats: LLaVA and ShareGPT (LLaMA-Factory / ms-swift) rows, ``data.format``
detection, Hugging Face datasets (parquet, ``save_to_disk``), video refused with its row."""

from __future__ import annotations

import json
import re
from itertools import islice
from pathlib import Path

import pytest
import ray
import test_data_fakes
import torch
from test_data_fakes import families, make_tokenizer_dir, write_image, write_jsonl

from disagg.config.schema import Config
from disagg.data import DataError, build_data_source
from disagg.data.formats import VideoError, detect_format
from disagg.data.index import index_dataset
from disagg.data.preprocess import preprocess_record
from disagg.data.records import Record, parse_sample

ray.cloudpickle.register_pickle_by_value(test_data_fakes)  # Ray workers cannot import test modules


def llava(images: list[str], prompt: str, answer: str, system: str | None = None) -> dict:
    turns = ([{"from": "system", "value": system}] if system else []) + [
        {"from": "human", "value": "<image>" * len(images) + prompt},
        {"from": "gpt", "value": answer},
    ]
    row: dict = {"conversations": turns}
    if images:
        row["image"] = images if len(images) > 1 else images[0]
    return row


def sharegpt(images: list[str], prompt: str, answer: str, system: str | None = None) -> dict:
    """The same sample as LLaMA-Factory writes it (``mllm_demo.json``: messages + images,
    the system prompt in its own column)."""
    row: dict = {
        "messages": [
            {"role": "user", "content": "<image>" * len(images) + prompt},
            {"role": "assistant", "content": answer},
        ]
    }
    if images:
        row["images"] = images
    if system:
        row["system"] = system
    return row


ROWS = [
    (["a.png"], "Describe.", "A red square.", None),
    ([], "Answer briefly.", "A blue circle.", "Be brief."),
    (["a.png", "wide.png"], "Compare.", "Two red squares.", None),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    make_tokenizer_dir(root)
    write_image(root / "a.png", 8, 8)
    write_image(root / "wide.png", 16, 8, (0, 0, 255))
    return root


def config(root: Path, train, **data) -> Config:
    return Config(
        model={
            "vision": {"family": "fake_image", "path": str(root / "tok")},
            "llm": {"family": "fake_lm", "path": str(root / "tok")},
        },
        data={"train": train, "media_root": str(root), "batch_size": 3, "num_workers": 1, "shuffle": False}
        | data,
    )


def processed(root: Path, item: dict, fmt: str) -> dict:
    fams = families(root / "tok")
    messages, media = parse_sample(item, "t:1", root, {"image"}, fmt)
    out = preprocess_record(Record(0, 0, "t:1", messages, media), fams, fams["llm"].tokenizer())
    return out.inputs


def llama_factory_conversations(images: list[str], prompt: str, answer: str, system: str | None = None):
    """LLaMA-Factory's default sharegpt columns: ``conversations`` of ``from``/``value``."""
    row = sharegpt(images, prompt, answer, system)
    turns = row.pop("messages")
    row["conversations"] = [
        {"from": {"user": "human"}.get(t["role"], "gpt"), "value": t["content"]} for t in turns
    ]
    return row


def ms_swift(images: list[str], prompt: str, answer: str, system: str | None = None):
    """ms-swift: the system prompt is a turn, the media a plain list."""
    row = sharegpt(images, prompt, answer)
    if system:
        row["messages"].insert(0, {"role": "system", "content": system})
    return row


def trl_parts(images: list[str], prompt: str, answer: str, system: str | None = None):
    """TRL / HF-hub VLM sets: content as a list of typed parts."""
    row = ms_swift(images, prompt, answer, system)
    user = row["messages"][-2]
    user["content"] = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
    return row


@pytest.mark.parametrize("row", ROWS, ids=["image", "system+text", "two images"])
@pytest.mark.parametrize("spelling", [sharegpt, llama_factory_conversations, ms_swift, trl_parts])
def test_sharegpt_row_equals_its_llava_row(root, row, spelling):
    a, b = processed(root, llava(*row), "llava"), processed(root, spelling(*row), "sharegpt")
    assert a.keys() == b.keys()
    for m in a:
        assert a[m].keys() == b[m].keys()
        for k in a[m]:
            assert torch.equal(a[m][k], b[m][k]), (m, k)


def test_sharegpt_images_were_misread_before(root):
    """The old message: a LLaMA-Factory row read as LLaVA. Now it says which key and format."""
    with pytest.raises(
        DataError, match=r"t:1: sample has 'images', a sharegpt key.*set data.format: sharegpt"
    ):
        parse_sample(sharegpt(*ROWS[0]), "t:1", root, {"image"}, "llava", "data.format: llava")
    with pytest.raises(DataError, match=r"sample has 'image', a llava key.*set data.format: llava"):
        parse_sample(llava(*ROWS[0]), "t:1", root, {"image"}, "sharegpt")


def test_auto_detects_and_names_the_deciding_row(root):
    text = sharegpt([], "Hi.", "Hello.")
    p = write_jsonl(root / "lf.jsonl", [text, sharegpt(*ROWS[0])])
    ix = index_dataset(p, root)
    assert (ix.format, ix.how) == ("sharegpt", f"data.format: auto detected sharegpt from {p}:2")
    p = write_jsonl(root / "lv.json", [])
    p.write_text(json.dumps([llava(*ROWS[0])]))
    assert index_dataset(p, root).format == "llava"
    # an explicit format is taken as given
    assert index_dataset(root / "lf.jsonl", root, "llava").how == "data.format: llava"
    # a malformed first line is the stream's to report (or skip): detection reads past it
    p = write_jsonl(root / "broken_first.jsonl", ['{"messages": [', sharegpt(*ROWS[0])])
    assert index_dataset(p, root).how == f"data.format: auto detected sharegpt from {p}:2"


@pytest.mark.parametrize(
    "first, problem",
    [
        ({"text": "hello"}, "unknown row format (keys: text); allowed: llava"),
        ({**llava(*ROWS[0]), "images": ["a.png"]}, "ambiguous row"),
        ([1, 2], "a sample must be a JSON object"),
    ],
)
def test_auto_refuses_an_unknown_or_ambiguous_first_row(root, first, problem):
    p = write_jsonl(root / "odd.jsonl", [first, llava(*ROWS[0])])
    with pytest.raises(DataError, match=f"{p}:1: data.format: auto: .*{re.escape(problem)}"):
        index_dataset(p, root)
    # detect_format alone: an ambiguous later row decides too
    if isinstance(first, dict) and "images" in first:
        with pytest.raises(DataError, match=r"x:2: .*ambiguous"):
            detect_format([("x:1", sharegpt([], "a", "b")), ("x:2", first)])


def test_sharegpt_dataset_streams_the_llava_samples(ray_local, root):
    lv = write_jsonl(root / "s_lv.jsonl", [llava(*r) for r in ROWS])
    lf = write_jsonl(root / "s_lf.jsonl", [sharegpt(*r) for r in ROWS])
    got = []
    for path in (lv, lf):
        src = build_data_source(config(root, str(path)), families(root / "tok"))
        (batch,) = islice(src.batches(), 1)
        got.append([{m: ray.get(r) for m, r in s.inputs.items()} for s in batch])
    assert len(got[0]) == 3
    for a, b in zip(*got):
        for m in a:
            assert all(torch.equal(a[m][k], b[m][k]) for k in a[m]), m


VIDEO_ROWS = [
    {**sharegpt(*ROWS[0]), "videos": ["clip.mp4"]},
    {
        "video": "clip.mp4",
        "conversations": [{"from": "human", "value": "<video>What?"}, {"from": "gpt", "value": "A."}],
    },
    sharegpt([], "<video>What happens?", "A."),  # a marker alone: no key to find without parsing
    {
        "messages": [
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hm?"}]},
            {"role": "assistant", "content": "A."},
        ]
    },
]


def test_video_rows_are_refused_before_any_worker(ray_local, root):
    good = sharegpt(*ROWS[0])
    # the marker-only row too: the index parses every line that holds the bytes "video"
    path = write_jsonl(root / "video.jsonl", [good, VIDEO_ROWS[0], good, VIDEO_ROWS[1], good, VIDEO_ROWS[2]])
    listed = rf"{path}:2: 3 sample\(s\) with video \({path}:2, {path}:4, {path}:6\)"
    with pytest.raises(VideoError, match=listed):
        build_data_source(config(root, str(path), format="sharegpt"), families(root / "tok"))


def test_video_rows_the_index_cannot_see_stop_the_stream_even_with_skip(ray_local, root, tmp_path):
    """A ``<video>`` marker in a parquet table's text (only video columns are scanned up
    front): the row is refused when the stream reaches it, at the first batch here."""
    datasets = pytest.importorskip("datasets")
    good = {**sharegpt([], "Hi.", "Hello."), "images": []}
    rows = [good, {**sharegpt([], "<video>What happens?", "A."), "images": []}, good]
    path = tmp_path / "v.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    for on_error in ("error", "skip"):
        src = build_data_source(config(root, str(path), on_error=on_error), families(root / "tok"))
        refused = rf"{path}\[1\]: sample has a <video> marker, but video is not supported"
        with pytest.raises(DataError, match=refused):
            next(src.batches())


def test_data_check_lists_every_video_row(ray_local, root, disagg_registry, tmp_path):
    from test_data_check import FakesPlugin

    from disagg.cli.main import main
    from disagg.plugins import register_plugin

    register_plugin(FakesPlugin(), name="fakes")
    good = sharegpt(*ROWS[0])
    path = write_jsonl(tmp_path / "v.jsonl", [good, *VIDEO_ROWS, good])
    cfg = config(root, str(path)).model_dump(exclude_defaults=True)
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    out = tmp_path / "r.json"
    assert main(["data", "check", str(tmp_path / "c.yaml"), "--no-progress", "--report", str(out)]) == 1
    report = json.loads(out.read_text())
    assert (report["ok"], report["bad"]) == (2, 4)
    assert [p.split(": ")[0] for p in report["problems"]] == [f"{path}:{n}" for n in (2, 3, 4, 5)]
    assert all("video is not supported" in p for p in report["problems"])
    assert report["formats"] == [f"{path}: sharegpt (data.format: auto detected sharegpt from {path}:1)"]


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk", "parquet_dir", "embedded_images", "jsonl_dir"])
def test_hf_dataset_reads_the_jsonl_samples(ray_local, root, tmp_path, layout):
    datasets = pytest.importorskip("datasets")
    rows = [sharegpt(*r) for r in ROWS] * 2
    for r in rows:
        r.setdefault("images", [])
        r.setdefault("system", "")
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    if layout == "embedded_images":
        # the Image feature: encoded bytes in the table, no file beside it
        embedded = [{**r, "images": [{"bytes": (root / f).read_bytes()} for f in r["images"]]} for r in rows]
        ds = datasets.Dataset.from_list(embedded).cast_column("images", datasets.List(datasets.Image()))
    if layout == "save_to_disk":
        path = tmp_path / "saved"
        ds.save_to_disk(str(path))
    elif layout == "parquet_dir":
        (tmp_path / "pq" / "data").mkdir(parents=True)
        ds.select(range(4)).to_parquet(str(tmp_path / "pq" / "data" / "train-00000-of-00002.parquet"))
        ds.select(range(4, 6)).to_parquet(str(tmp_path / "pq" / "data" / "train-00001-of-00002.parquet"))
        path = tmp_path / "pq"
    elif layout == "jsonl_dir":
        (tmp_path / "js" / "data").mkdir(parents=True)
        write_jsonl(tmp_path / "js" / "data" / "a.jsonl", rows[:4])
        write_jsonl(tmp_path / "js" / "data" / "b.jsonl", ["", *rows[4:]])  # a blank first line
        path = tmp_path / "js"
    else:
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path), batch_size=2)  # several row groups
    fmt = "hf" if layout != "parquet" else "auto"
    got, sources = {}, {}
    for name, p in (("jsonl", jsonl), ("hf", path)):
        src = build_data_source(
            config(root, str(p), format=fmt if name == "hf" else "auto"), families(root / "tok")
        )
        assert src.indexes[0].format == "sharegpt"
        batches = list(islice(src.batches(), 2))
        got[name] = [{m: ray.get(r) for m, r in s.inputs.items()} for b in batches for s in b]
        sources[name] = [s.source for b in batches for s in b]
    assert len(got["hf"]) == 6
    where = {
        "parquet": [f"{path}[{j}]" for j in range(6)],
        "jsonl_dir": [f"{path}/data/a.jsonl:{n}" for n in (1, 2, 3, 4)]
        + [f"{path}/data/b.jsonl:{n}" for n in (2, 3)],
    }
    if layout in where:
        assert sources["hf"] == where[layout]
    for a, b in zip(got["jsonl"], got["hf"]):
        assert a.keys() == b.keys()
        for m in a:
            assert all(torch.equal(a[m][k], b[m][k]) for k in a[m]), (layout, m)


def test_hf_errors_name_the_path(root, tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([sharegpt(*ROWS[1])])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict dir holds several splits; name one: .*dd/train"):
        index_dataset(tmp_path / "dd", root)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a Hugging Face dataset dir"):
        index_dataset(tmp_path / "empty", root)
    with pytest.raises(DataError, match="data.format: hf needs a Hugging Face dataset dir"):
        index_dataset(write_jsonl(tmp_path / "x.jsonl", [sharegpt(*ROWS[1])]), root, "hf")
    # parquet video column: refused by row without reading the other columns
    ds = datasets.Dataset.from_list(
        [{**sharegpt(*ROWS[1]), "videos": []}, {**sharegpt(*ROWS[1]), "videos": ["v.mp4"]}]
    )
    ds.to_parquet(str(tmp_path / "v.parquet"))
    assert index_dataset(tmp_path / "v.parquet", root).video_rows() == [f"{tmp_path / 'v.parquet'}[1]"]


def test_pixel_limits_are_validated_against_the_family(root, disagg_registry):
    """The fake image family has a fixed patch grid (no ``pixel_limits``): the keys are refused
    at validation, naming them; so is a budget whose minimum exceeds its maximum."""
    from test_data_check import FakesPlugin

    from disagg.config.errors import ConfigError
    from disagg.config.validate import validate
    from disagg.plugins import get_registry, register_plugin

    register_plugin(FakesPlugin(), name="fakes")
    path = write_jsonl(root / "px.jsonl", [llava(*ROWS[0])])
    with pytest.raises(ConfigError) as info:
        validate(config(root, str(path), max_pixels=1000, min_pixels=2000), get_registry())
    text = str(info.value)
    assert "data.min_pixels" in text and "2000 is larger than data.max_pixels = 1000" in text
    assert "family 'fake_image' (model.vision) resizes every image to its fixed input size" in text
    assert "remove data.max_pixels" in text
    validate(config(root, str(path)), get_registry())  # without them: fine


def test_docs_examples_read_as_their_format(root):
    """Each JSON example in docs/data.md's formats section is detected as the format it
    illustrates and parses (its image file stood in for by a test image)."""
    page = (Path(__file__).resolve().parents[3] / "docs" / "data.md").read_text()
    found = re.findall(r"<!-- data-format: (\w+) -->\n```(\w+)\n(.*?)\n```", page, re.S)
    assert [f for f, _, _ in found] == ["llava", "sharegpt", "hf"]
    for fmt, lang, text in found:
        if lang != "json":
            assert "save_to_disk" in text
            continue
        item = json.loads(text)
        assert detect_format([("docs/data.md", item)])[0] == fmt
        (root / "shapes").mkdir(exist_ok=True)
        write_image(root / "shapes" / "red_square.png", 8, 8)
        messages, media = parse_sample(item, "docs/data.md", root, {"image"}, fmt)
        assert len(media["image"]) == 1 and messages[-1] == ("assistant", "A red square.")


def test_embedded_media_bytes_equal_their_files(root):
    """A Hugging Face ``Image``/``Audio`` value (``{"bytes", "path"}``) holding the encoded file
    decodes to what the file does (LLaVA-OneVision-style rows: a singular ``image`` struct)."""
    from test_data_fakes import write_wav

    from disagg.data.media import load_media

    write_wav(root / "beep.wav", 250)
    wav_file, wav_bytes = (
        load_media("audio", str(root / "beep.wav")),
        load_media("audio", (root / "beep.wav").read_bytes()),
    )
    assert (
        wav_file["sampling_rate"] == wav_bytes["sampling_rate"]
        and (wav_file["array"] == wav_bytes["array"]).all()
    )
    row = llava(["a.png"], "Describe.", "A red square.")
    embedded = {**row, "image": {"bytes": (root / "a.png").read_bytes(), "path": None}}
    by_path = {**row, "image": {"bytes": None, "path": "a.png"}}
    _, media = parse_sample(embedded, "t:1", root, {"image"}, "llava")
    assert isinstance(media["image"][0], bytes)
    want = processed(root, row, "llava")
    for item in (embedded, by_path):
        got = processed(root, item, "llava")
        assert all(torch.equal(got[m][k], want[m][k]) for m in want for k in want[m])
    empty = r"t:1: an image value \(a Hugging Face Image feature\) holds neither bytes nor a path"
    with pytest.raises(DataError, match=empty):
        parse_sample({**row, "image": {"bytes": None, "path": None}}, "t:1", root, {"image"}, "llava")
