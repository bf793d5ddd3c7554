"""Held-out evaluation of the demo: greedy captions from a Hugging Face dir.

The model is loaded with plain ``transformers`` (``from_pretrained`` of the
exported checkpoint), so the score is what a user of the exported model gets.
Prompts are built exactly as in training: the families' preprocessing and
placeholder text, the tokenizer's chat template with the generation prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from disagg.data.media import load_image
from disagg.plugins import get_registry
from disagg.tiny import COLOURS, SHAPES


def load_eval(
    eval_jsonl: str | Path, media_root: str | Path, limit: int | None = None
) -> list[tuple[Path, str, str]]:
    """``(image, prompt, caption)`` of each held-out sample."""
    rows = [json.loads(line) for line in Path(eval_jsonl).read_text().splitlines() if line.strip()]
    out = []
    for r in rows[:limit]:
        turns = r["conversations"]
        out.append((Path(media_root) / r["image"], turns[0]["value"], turns[1]["value"]))
    return out


def words(text: str) -> tuple[str | None, str | None]:
    """The colour and shape a caption names (None when it names none)."""
    toks = text.lower().replace(".", " ").split()
    colour = next((t for t in toks if t in COLOURS), None)
    shape = next((t for t in toks if t in SHAPES), None)
    return colour, shape


@torch.no_grad()
def evaluate(
    model_dir: str | Path, family: str, samples: list[tuple[Path, str, str]], max_new_tokens: int = 8
) -> dict[str, Any]:
    """Greedy-decode a caption per sample; exact-match rate and colour/shape accuracy."""
    import transformers
    from transformers import AutoConfig

    reg = get_registry()
    vision = reg.family("encoder", family)(model_dir)
    llm = reg.family("llm", family)(model_dir)
    tok = llm.tokenizer()
    arch = getattr(transformers, AutoConfig.from_pretrained(model_dir).architectures[0])
    model = arch.from_pretrained(model_dir, dtype=torch.float32).eval()
    stop = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id

    exact = colour_ok = shape_ok = 0
    examples = []
    for image, prompt, caption in samples:
        enc = vision.preprocess([load_image(str(image))])
        n = vision.num_tokens(enc)[0]
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt.replace("<image>", llm.placeholder_text("vision", n))}],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=tok.pad_token_id,
            **{**enc, **llm.extra_inputs({"vision": enc})},
        )
        said = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        exact += said == caption
        (c, s), (c_ref, s_ref) = words(said), words(caption)
        colour_ok += c == c_ref
        shape_ok += s == s_ref
        if len(examples) < 4:
            examples.append({"image": image.name, "caption": caption, "generated": said})
    n = max(len(samples), 1)
    return {
        "exact_match": exact / n,
        "colour_acc": colour_ok / n,
        "shape_acc": shape_ok / n,
        "n": len(samples),
        "examples": examples,
    }
