"""Sharded checkpoints with resharding (issue 26 item 2), through ``torch.distributed.checkpoint``:
``megatron_tp`` 2 x 2 replicas on 4 ranks writes only its own pieces of parameters and AdamW
state (each rank's file about a quarter of the group's state: the replicas' equal pieces are
written once, by either), and fresh groups resume from it: the same layout bit for bit (after
the load and after the next step), ``megatron_tp`` 4 and ``ddp`` x 4 with the saved state
exactly (pieces are copied, never recomputed) and the next step within the fp32 policy
(other reduction orders). Tiny qwen2: tied embeddings, vocabulary 498 (padded under degree 4),
grouped key/value heads replicated under degree 4. The LoRA save resumes under ``zero`` stage 3
x 4 too, from either form, reading exactly each rank's partitions of the trained state."""

from __future__ import annotations

import sys
from pathlib import Path

# llm-tp's case kit (batches, step settings); spawned ranks inherit this path. The test lives
# here, not in llm-tp's tests, because it drives core's runtime (the actor's checkpoint
# functions), which plugin tests may not import (test_import_rules).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "llm-tp" / "tests"))

from ckpt_cases import ckpt_rank  # noqa: E402
from tp_cases import make_batch  # noqa: E402

from disagg.kit.checkpoint import payload_by_file  # noqa: E402
from disagg.testing.dist import run_ranks  # noqa: E402
from disagg.testing.ranks import dumps, loads  # noqa: E402
from disagg.testing.tolerance import assert_exact, assert_tensors_close  # noqa: E402
from disagg_llm_tp.families.qwen2 import Qwen2Family  # noqa: E402


def test_sharded_save_resumes_in_any_layout(tmp_path):
    # llm-tp's tiny qwen2 (its conftest's): tied embeddings, a vocabulary 4 does not divide
    path = str(Qwen2Family.make_tiny(tmp_path / "qwen2", vocab_size=498, tie_word_embeddings=True))
    samples, embeds = make_batch(Qwen2Family(path), n_samples=4, seed=5)
    out = [loads(b) for b in run_ranks(ckpt_rank, 4, dumps((path, str(tmp_path), samples, embeds)))]
    saved, uninterrupted = out[0]["saved"], out[0]["uninterrupted"]
    assert any(k.startswith("optim/") for k in saved) and any(k.endswith("/exp_avg_sq") for k in saved)

    # each rank wrote its own DCP file (rank 0 the metadata too); by the metadata, every element
    # of the state is in exactly one file, about a quarter of it in each
    for rank, r in enumerate(out):
        mine = [f for f in r["files"] if f.startswith("llm/dcp/") and f.endswith(".distcp")]
        assert mine == [f"llm/dcp/__{rank}_0.distcp"], r["files"]
        assert (Path(tmp_path) / mine[0]).stat().st_size == r["files"][mine[0]]["bytes"]
    assert "llm/dcp/.metadata" in out[0]["files"]
    payload = payload_by_file(Path(tmp_path) / "llm" / "dcp")
    unique = {k: v for k, v in saved.items() if k != "param/lm_head.weight"}  # tied: one tensor, two names
    state_bytes = sum(v.numel() * v.element_size() for v in unique.values())
    tied = saved["param/lm_head.weight"]
    assert sum(payload.values()) == state_bytes + tied.numel() * tied.element_size()
    for name, n in payload.items():
        assert 0.2 < n / sum(payload.values()) < 0.3, (name, payload)

    for rank, r in enumerate(out):
        assert_exact(r["saved"], saved, f"rank {rank} merged state: ")
        assert_exact(r["tp2/loaded"], saved, f"same layout, rank {rank}, loaded: ")
        assert_exact(r["tp2/stepped"], r["uninterrupted"], f"same layout, rank {rank}, resumed step: ")
        for kind in ("tp4", "ddp"):
            assert_exact(r[f"{kind}/loaded"], saved, f"tp2 -> {kind}, rank {rank}, loaded: ")
            params = {k: v for k, v in r[f"{kind}/stepped"].items() if k.startswith("param/")}
            want = {k: v for k, v in uninterrupted.items() if k.startswith("param/")}
            assert_tensors_close(params, want, f"tp2 -> {kind}, rank {rank}, resumed step: ")
        # TP 4 saves its own pieces too; TP 2 loads them exactly
        assert [f for f in r["tp4/files"] if f.endswith(".distcp")] == [f"llm/dcp/__{rank}_0.distcp"]
        assert_exact(r["tp4->tp2/loaded"], out[0]["tp4/stepped"], f"tp4 -> tp2, rank {rank}, loaded: ")
    tp4 = payload_by_file(Path(tmp_path) / "tp4" / "llm" / "dcp")
    for name, n in tp4.items():
        assert 0.2 < n / sum(tp4.values()) < 0.3, (name, tp4)
    _assert_lora(out, Path(tmp_path) / "lora")


def _assert_lora(out: list[dict], root: Path) -> None:
    """LoRA under megatron_tp 2 x 2 (adapter dropout on): the sharded checkpoint holds the
    adapters' pieces and their AdamW state only, spread over the ranks' files; the same layout
    resumes bit for bit (random streams included), TP 4 and ddp x 4 load it exactly (the base
    from the model dir, unchanged); a resume reads only its own pieces of the trained tensors,
    from the sharded form and from the full form alike (never merging or gathering the base)."""
    from torch.distributed.checkpoint import FileSystemReader

    lora = [r["lora"] for r in out]
    saved = lora[0]["saved"]
    stored = FileSystemReader(str(root / "llm" / "dcp")).read_metadata().state_dict_metadata
    trained = {k for k in stored if k.startswith("param/")}
    assert trained and all(".lora_A." in k or ".lora_B." in k for k in trained), sorted(trained)[:4]
    assert trained == {k for k in saved if k.startswith("param/") and ".lora_" in k}
    assert {
        k.rpartition("/")[0].replace("optim/", "param/", 1) for k in stored if k.startswith("optim/")
    } == trained
    payload = payload_by_file(root / "llm" / "dcp")
    assert len(payload) == 4, payload
    trained_bytes = sum(
        saved[k].numel() * saved[k].element_size()
        for k in saved
        if k in trained or (k.startswith("optim/") and k.rpartition("/")[2] != "step")
    )
    for rank, r in enumerate(lora):
        assert_exact(r["tp2/loaded"], saved, f"LoRA same layout, rank {rank}, loaded: ")
        assert_exact(
            r["tp2/stepped"], lora[0]["uninterrupted"], f"LoRA same layout, rank {rank}, resumed step: "
        )
        for kind in ("tp4", "ddp", "full"):
            assert_exact(r[f"{kind}/loaded"], saved, f"LoRA tp2 -> {kind}, rank {rank}, loaded: ")
        # bytes read by a resume, from either form: its own pieces of the trained state, never
        # the base (the full form's resume does not merge it: ckpt_cases._no_merge)
        assert r["full/read"] == r["tp2/read"] < trained_bytes, (r["tp2/read"], trained_bytes, r["full/read"])
        # zero 3 x 4 (DeepSpeed's partitions) from either form: exactly its own pieces
        for form in ("sharded", "full"):
            assert_exact(
                r[f"zero3/{form}/loaded"], saved, f"LoRA tp2 -> zero 3 ({form}), rank {rank}, loaded: "
            )
            assert r[f"zero3/{form}/read"] == r["zero3/own"], (form, r[f"zero3/{form}/read"], r["zero3/own"])
        assert abs(r["zero3/own"] / trained_bytes - 0.25) < 0.02, (r["zero3/own"], trained_bytes)
    print(
        "LoRA resume bytes read per rank, sharded / full form:",
        [round(r["tp2/read"] / r["full/read"], 4) for r in lora],
        "zero 3 x 4 read / trained bytes:",
        [round(r["zero3/sharded/read"] / trained_bytes, 4) for r in lora],
        "per-rank file fraction:",
        [round(n / sum(payload.values()), 3) for n in payload.values()],
    )
