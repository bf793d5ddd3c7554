"""Small families with a real HF tokenizer, for the data-pipeline tests.

Not tests themselves: imported by the ``test_data_*`` modules. The image
family makes one token per 4x4 pixel patch, the audio family one token per
100 samples; the LLM family wraps placeholders Qwen-style.
"""

from __future__ import annotations

import json
import math
import wave
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from disagg.interfaces import EncoderFamily, LanguageFamily
from disagg.tiny import train_tokenizer

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|audio_pad|>",
]
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


def make_tokenizer_dir(root: Path) -> Path:
    out = Path(root) / "tok"
    train_tokenizer(out, SPECIAL, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML)
    return out


class FakeImageFamily(EncoderFamily):
    name: ClassVar[str] = "fake_image"
    modality: ClassVar[str] = "image"

    def build(self, dtype=torch.float32):
        raise NotImplementedError

    def export_state(self, state):
        return state

    def encode(self, module, inputs):
        raise NotImplementedError

    def preprocess(self, media: list[Any]) -> dict[str, torch.Tensor]:
        arrays = [torch.from_numpy(np.asarray(im, dtype=np.float32)).reshape(-1, 3) for im in media]
        grid = [[im.height // 4, im.width // 4] for im in media]
        return {"pixels": torch.cat(arrays), "grid": torch.tensor(grid, dtype=torch.int64)}

    def num_tokens(self, inputs):
        return [int(h * w) for h, w in inputs["grid"].tolist()]


class FakeAudioFamily(FakeImageFamily):
    name: ClassVar[str] = "fake_audio"
    modality: ClassVar[str] = "audio"

    def preprocess(self, media):
        arrays = [torch.from_numpy(m["array"]) for m in media]
        return {"wave": torch.cat(arrays), "lengths": torch.tensor([len(a) for a in arrays])}

    def num_tokens(self, inputs):
        return [math.ceil(n / 100) for n in inputs["lengths"].tolist()]


class FakeLMFamily(LanguageFamily):
    name: ClassVar[str] = "fake_lm"

    def build(self, dtype=torch.float32):
        raise NotImplementedError

    def export_state(self, state):
        return state

    def forward(self, module, inputs, embeds):
        raise NotImplementedError

    def tokenizer(self):
        if not hasattr(self, "_tok"):
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.path)
        return self._tok

    def __getstate__(self):  # tokenizers are rebuilt in each worker, not shipped
        return {k: v for k, v in self.__dict__.items() if k != "_tok"}

    def placeholder_token_id(self, module: str) -> int:
        pad = {"vision": "<|image_pad|>", "audio": "<|audio_pad|>"}[module]
        return self.tokenizer().convert_tokens_to_ids(pad)

    def placeholder_text(self, module: str, n_tokens: int) -> str:
        pad = {"vision": "<|image_pad|>", "audio": "<|audio_pad|>"}[module]
        return "<|vision_start|>" + pad * n_tokens + "<|vision_end|>"

    def extra_inputs(self, encoder_inputs):
        return {"image_grid": encoder_inputs["vision"]["grid"]} if "vision" in encoder_inputs else {}


def families(tok_dir: Path, audio: bool = False) -> dict[str, Any]:
    fams: dict[str, Any] = {"vision": FakeImageFamily(tok_dir), "llm": FakeLMFamily(tok_dir)}
    if audio:
        fams["audio"] = FakeAudioFamily(tok_dir)
    return fams


def write_image(path: Path, w: int, h: int, colour=(255, 0, 0)) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (w, h), colour).save(path)
    return path


def write_wav(path: Path, n: int, rate: int = 1600) -> Path:
    t = np.arange(n) / rate
    data = (0.5 * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(data.tobytes())
    return path


def write_jsonl(path: Path, samples: list[Any]) -> Path:
    path.write_text("".join((s if isinstance(s, str) else json.dumps(s)) + "\n" for s in samples))
    return path


def caption_sample(image: str, caption: str) -> dict[str, Any]:
    return {
        "image": image,
        "conversations": [
            {"from": "human", "value": "<image>\nDescribe."},
            {"from": "gpt", "value": caption},
        ],
    }
