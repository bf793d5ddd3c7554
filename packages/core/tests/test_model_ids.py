"""``model.<module>.path`` as a Hugging Face model id, resolved through
``huggingface_hub`` on the driver before any actor starts.

The hub cache is written locally in the hub's layout (``disagg.testing.hub``)
under a temporary ``HF_HOME``, with ``HF_HUB_OFFLINE=1``: the real resolution,
no network. ``huggingface_hub`` reads those variables when it is imported, so
in this process the test sets its constants to what the environment now says;
one subprocess checks that the environment alone is honoured.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from disagg.config.errors import ConfigError
from disagg.config.model_path import parse_model_id
from disagg.config.schema import Config
from disagg.config.validate import validate
from disagg.testing import toy
from disagg.testing.hub import populate_hub_cache
from disagg.testing.toy import ToyDataSource, make_toy_dirs


@pytest.fixture
def toy_registry(disagg_registry):
    from disagg.plugins import register_plugin

    return register_plugin(toy, name="disagg.testing.toy")


@pytest.fixture
def hub(tmp_path, monkeypatch) -> dict[str, Path]:
    """HF_HOME in tmp, offline, holding ``some-org/tiny-vl`` (the toy LM, at
    ``main``) and ``some-org/toy-encoder`` (at its tag ``v1`` only)."""
    import huggingface_hub.constants as constants

    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    enc, lm = make_toy_dirs(tmp_path / "models")
    return {
        "home": home,
        "lm": populate_hub_cache(home / "hub", "some-org/tiny-vl", lm),
        "enc": populate_hub_cache(home / "hub", "some-org/toy-encoder", enc, refs=("v1",)),
    }


def _cfg(tmp_path: Path, vision: str, llm: str) -> Config:
    return Config.model_validate(
        {
            "model": {"vision": {"family": "toy", "path": vision}, "llm": {"family": "toy", "path": llm}},
            "train": {"steps": 2, "lr": 1e-2},
            "checkpoint": {"every": 2},
            "output_dir": str(tmp_path / "run"),
        }
    )


def test_model_ids_resolve_to_cached_snapshots_and_train(ray_local, toy_registry, hub, tmp_path):
    from disagg.runtime.export import export_checkpoint, read_manifest
    from disagg.runtime.run import run_training

    resolved = validate(_cfg(tmp_path, "some-org/toy-encoder@v1", "some-org/tiny-vl"), toy_registry)
    assert resolved.config.model.llm.path == str(hub["lm"])
    assert resolved.config.model.vision.path == str(hub["enc"])  # the tag's commit
    summary = run_training(resolved, registry=toy_registry, data_source=ToyDataSource(4), progress=False)
    assert summary["status"] == "ok" and summary["steps"] == 2
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert written["model"]["llm"]["path"] == str(hub["lm"])  # the run records the snapshot (its commit)
    export_checkpoint(tmp_path / "run" / "checkpoints" / "step-2", tmp_path / "export", toy_registry)
    assert read_manifest(tmp_path / "export")["modules"]["llm"]["source"] == str(hub["lm"])


def test_uncached_id_is_one_clear_error_before_any_actor(toy_registry, hub, tmp_path):
    from disagg.cli.main import main

    cfg = _cfg(tmp_path, "some-org/toy-encoder@v1", "some-org/not-cached")
    with pytest.raises(ConfigError) as err:
        validate(cfg, toy_registry)
    (problem,) = err.value.problems
    assert problem.key == "model.llm.path"
    for needle in (
        "'some-org/not-cached'",
        "Hugging Face model id",
        "HF_HUB_OFFLINE",
        str(hub["home"] / "hub"),
    ):
        assert needle in problem.message, problem.message

    # through the CLI: exit 2 with the file and line, and no run dir (run_training never started)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_defaults=True), sort_keys=False))
    assert main(["train", str(path)]) == 2
    assert not (tmp_path / "run").exists()


def test_unknown_revision_and_not_an_id(toy_registry, hub, tmp_path):
    with pytest.raises(ConfigError) as err:
        validate(_cfg(tmp_path, "some-org/toy-encoder", "some-org/tiny-vl"), toy_registry)
    (problem,) = err.value.problems  # the encoder is cached at v1 only, not at main
    assert problem.key == "model.vision.path" and "'some-org/toy-encoder'" in problem.message
    with pytest.raises(ConfigError) as err:
        validate(_cfg(tmp_path, "./no/such/dir", "some-org/tiny-vl"), toy_registry)
    (problem,) = err.value.problems
    assert "'./no/such/dir' does not exist" in problem.message and "model id" not in problem.message


def test_the_environment_alone_is_honoured(hub):
    """A fresh process with only HF_HOME and HF_HUB_OFFLINE set resolves the cached id."""
    code = "from disagg.config.model_path import resolve_model_path as r; print(r('some-org/tiny-vl'))"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(hub["home"]), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(hub["lm"])


@pytest.mark.parametrize(
    "path,want",
    [
        ("Qwen/Qwen2.5-VL-7B-Instruct", ("Qwen/Qwen2.5-VL-7B-Instruct", None)),
        ("some-org/tiny-vl@v1.0", ("some-org/tiny-vl", "v1.0")),
        ("org/name@refs/pr/3", ("org/name", "refs/pr/3")),
        ("/abs/dir", None),
        ("./rel/dir", None),
        ("a/b/c", None),
        ("no-slash", None),
        ("org/../x", None),
    ],
)
def test_what_counts_as_a_model_id(path, want):
    assert parse_model_id(path) == want


@pytest.mark.parametrize(
    "error,needle",
    [
        ("GatedRepoError", "is gated: accept its terms on huggingface.co/some-org/gated and set HF_TOKEN"),
        ("RepositoryNotFoundError", "is not on the Hub (or it is private: set HF_TOKEN"),
        ("RevisionNotFoundError", "has no revision 'v9'"),
    ],
)
def test_hub_refusals_name_the_id_and_the_reason(monkeypatch, error, needle):
    """What the Hub answers (simulated: no network here) becomes one sentence."""
    import huggingface_hub
    import huggingface_hub.errors as errors

    from disagg.config.model_path import ModelPathError, resolve_model_path

    # the HTTP client huggingface_hub is built on (httpx or its successor): its errors carry a response
    http = importlib.import_module(errors.Response.__module__.split(".")[0])
    response = http.Response(401, request=http.Request("GET", "https://huggingface.co/api/models"))

    def refuse(repo_id, revision=None):
        raise getattr(errors, error)(f"{repo_id}: refused", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ModelPathError) as err:
        resolve_model_path("some-org/gated@v9")
    assert "'some-org/gated@v9'" in str(err.value) and needle in str(err.value), err.value
