"""The ``--omni`` demo: a vision + audio + LLM model made of three HF dirs.

The composition of the issue: the vision tower of a (tiny) Qwen2.5-VL dir, the
encoder of a (tiny) Whisper dir with a projector initialised into the LLM's
width (Whisper dirs carry none), and a (tiny) Qwen2 LLM. The LLM is built as
wide as the Qwen2.5-VL merger's output, as with the real models (the
Qwen2.5-VL-7B merger feeds 3584-wide rows to the 3584-wide Qwen2.5-7B), and
Whisper's ``options.hidden_size`` is that width too.

The data (``make-tiny``'s ``omni_*.jsonl``) mixes image-only, audio-only,
image+audio and text-only samples: shapes are captioned by colour and shape,
tones by pitch. Held-out samples are answered greedily by the modules rebuilt
from the export's manifest (``disagg_model.json``): no single HF class holds
the three, so the prompt's placeholder rows come from the families' own
``encode``, as in training.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from evaluate import words

from disagg.data.media import load_media
from disagg.data.preprocess import modality_modules

VISION, AUDIO, LLM = "qwen2_5_vl", "whisper", "qwen2"
#: 0.5 s tones -> 25 Whisper positions -> 5 LLM rows; 5 divides the tiny encoder's 50-position window
AUDIO_STRIDE = 5
_MARKER = {"<image>": "image", "<audio>": "audio"}


def build_llm(tiny: Path, registry: Any) -> tuple[Path, int]:
    """The tiny Qwen2 LLM, as wide as the tiny Qwen2.5-VL merger's output."""
    width = registry.family("encoder", VISION)(tiny / VISION).hidden_size()
    # untied, as the plain demo's Qwen2.5-VL LLM: with tied embeddings the same 120 steps
    # reached a quarter of the held-out colour and pitch accuracy (8% vs 33%, 17% vs 67%)
    path = registry.family("llm", LLM).make_tiny(tiny / LLM, hidden_size=width, tie_word_embeddings=False)
    return path, width


def omni_model(tiny: Path, width: int) -> dict[str, Any]:
    return {
        "vision": {"family": VISION, "path": str(tiny / VISION)},
        "audio": {
            "family": AUDIO,
            "path": str(tiny / AUDIO),
            "options": {"hidden_size": width, "stride": AUDIO_STRIDE},
        },
        "llm": {"family": LLM, "path": str(tiny / LLM)},
    }


#: each module its own strategy: frames of a long image split over 2 ranks, the LLM's
#: layers over 2 ranks, the small audio encoder on one rank
OMNI_PARALLEL = {
    "placement": "collocated",
    "vision": {"strategy": "ulysses", "degree": 2, "replicas": 1},
    "audio": {"strategy": "ddp", "degree": 1, "replicas": 1},
    "llm": {"strategy": "megatron_tp", "degree": 2, "replicas": 1},
}


def load_omni_eval(eval_jsonl: str | Path, media_root: str | Path, limit: int | None) -> list[dict]:
    """``{"image": path | None, "audio": path | None, "prompt", "answer"}`` per held-out sample."""
    rows = [json.loads(line) for line in Path(eval_jsonl).read_text().splitlines() if line.strip()]
    out = []
    for r in rows[:limit]:
        turns = r["conversations"]
        out.append(
            {
                "image": str(Path(media_root) / r["image"]) if "image" in r else None,
                "audio": str(Path(media_root) / r["audio"]) if "audio" in r else None,
                "prompt": turns[0]["value"],
                "answer": turns[1]["value"],
            }
        )
    return out


def pitch(text: str) -> str | None:
    """The pitch a tone caption names: low, high, mid ("A tone."), or None."""
    t = text.lower()
    if "tone" not in t:
        return None
    return "low" if "low tone" in t else "high" if "high tone" in t else "mid"


@torch.no_grad()
def evaluate_omni(families: dict[str, Any], samples: list[dict], max_new_tokens: int = 12) -> dict[str, Any]:
    """Greedy answers; colour/shape accuracy on samples with an image, pitch
    accuracy on samples with audio, exact match on all and on text-only ones."""
    llm_fam = families["llm"]
    tok = llm_fam.tokenizer()
    modules = {m: fam.build().eval() for m, fam in families.items()}
    lm = modules["llm"]
    kind_module = modality_modules(families)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    hits = {"exact": 0, "colour": 0, "shape": 0, "pitch": 0, "text": 0}
    counts = {"all": 0, "image": 0, "audio": 0, "text": 0}
    examples = []
    for s in samples:
        rows, prompt = {}, s["prompt"]
        for kind in ("image", "audio"):
            if s[kind] is None:
                continue
            m = kind_module[kind]
            inputs = families[m].preprocess([load_media(kind, s[kind])])
            rows[m] = families[m].encode(modules[m], inputs)
            marker = next(k for k, v in _MARKER.items() if v == kind)
            n = families[m].num_tokens(inputs)[0]
            prompt = prompt.replace(marker, llm_fam.placeholder_text(m, n), 1)
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        embeds = lm.get_input_embeddings()(ids)
        for m, r in rows.items():
            where = (ids[0] == llm_fam.placeholder_token_id(m)).nonzero()[:, 0]
            embeds[0, where] = r.to(embeds.dtype)
        out = lm.generate(
            inputs_embeds=embeds,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=tok.pad_token_id,
        )
        said = tok.decode(out[0], skip_special_tokens=True).strip()
        counts["all"] += 1
        hits["exact"] += said == s["answer"]
        if s["image"]:
            counts["image"] += 1
            (c, sh), (c_ref, sh_ref) = words(said), words(s["answer"])
            hits["colour"] += c == c_ref
            hits["shape"] += sh == sh_ref
        if s["audio"]:
            counts["audio"] += 1
            hits["pitch"] += pitch(said) == pitch(s["answer"])
        if not s["image"] and not s["audio"]:
            counts["text"] += 1
            hits["text"] += said == s["answer"]
        if len(examples) < 4:
            media = " + ".join(Path(s[k]).name for k in ("image", "audio") if s[k]) or "(text)"
            examples.append({"media": media, "answer": s["answer"], "generated": said})
    rate = lambda k, n: hits[k] / max(counts[n], 1)  # noqa: E731
    return {
        "exact_match": rate("exact", "all"),
        "colour_acc": rate("colour", "image"),
        "shape_acc": rate("shape", "image"),
        "pitch_acc": rate("pitch", "audio"),
        "text_exact": rate("text", "text"),
        "n": counts,
        "examples": examples,
    }


def score(r: dict[str, Any]) -> float:
    return r["exact_match"] + r["colour_acc"] + r["shape_acc"] + r["pitch_acc"]


def report(r: dict[str, Any], name: str) -> str:
    return (
        f"held-out {name:6s}: exact match {r['exact_match']:.0%}, colour {r['colour_acc']:.0%}, "
        f"shape {r['shape_acc']:.0%}, pitch {r['pitch_acc']:.0%}, text-only exact {r['text_exact']:.0%}  "
        f"(n={r['n']['all']}: {r['n']['image']} with an image, {r['n']['audio']} with audio)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--omni",
        action="store_true",
        help="three modules from three dirs: Qwen2.5-VL vision + Whisper audio + Qwen2 LLM, "
        "on image, audio, image+audio and text-only samples",
    )
