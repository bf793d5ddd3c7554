"""A toy encoder + causal LM family pair in Hugging Face format, for core tests.

They are real ``PreTrainedModel`` subclasses saved with ``save_pretrained`` and
loaded with ``from_pretrained``, so core's tests go through the same code path
as real checkpoints, without any model-specific code in core itself. Plugin
authors can use them to test a strategy in isolation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from disagg import hookimpl
from disagg.interfaces import EncoderFamily, LanguageFamily, LayerMap


class ToyEncoderConfig(PretrainedConfig):
    model_type = "disagg_toy_encoder"

    def __init__(self, in_dim: int = 6, hidden: int = 16, heads: int = 2, out_hidden: int = 24, **kw: Any):
        self.in_dim, self.hidden, self.heads, self.out_hidden = in_dim, hidden, heads, out_hidden
        super().__init__(**kw)


class ToyLMConfig(PretrainedConfig):
    model_type = "disagg_toy_lm"

    def __init__(
        self,
        vocab_size: int = 40,
        hidden: int = 24,
        heads: int = 2,
        layers: int = 2,
        image_token_id: int = 3,
        audio_token_id: int = 4,
        **kw: Any,
    ):
        self.vocab_size, self.hidden, self.heads, self.layers = vocab_size, hidden, heads, layers
        self.image_token_id, self.audio_token_id = image_token_id, audio_token_id
        super().__init__(**kw)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1 = nn.LayerNorm(hidden)
        # no bias: a key bias has an exactly-zero gradient (softmax shift
        # invariance), so Adam would amplify pure rounding noise in comparisons
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H]
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ToyEncoder(PreTrainedModel):
    config_class = ToyEncoderConfig
    base_model_prefix = "toy_encoder"

    def __init__(self, config: ToyEncoderConfig):
        super().__init__(config)
        self.patch = nn.Linear(config.in_dim, config.hidden)
        self.block = Block(config.hidden, config.heads, causal=False)
        self.projector = nn.Linear(config.hidden, config.out_hidden)
        self.post_init()

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # one item [n, in_dim] -> [n, out]
        return self.projector(self.block(self.patch(patches)[None])[0])


class ToyLM(PreTrainedModel):
    config_class = ToyLMConfig
    base_model_prefix = "toy_lm"

    def __init__(self, config: ToyLMConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.blocks = nn.ModuleList(
            Block(config.hidden, config.heads, causal=True) for _ in range(config.layers)
        )
        self.norm = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        x = inputs_embeds
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


class ToyEncoderFamily(EncoderFamily):
    """Media item = float tensor ``[n_patches, in_dim]``; one token per patch."""

    name: ClassVar[str] = "toy"
    modality: ClassVar[str] = "image"

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        return ToyEncoder.from_pretrained(self.path, torch_dtype=dtype)

    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        heads = ToyEncoderConfig.from_pretrained(self.path).heads
        if strategy != "ddp" and heads % degree:
            return [f"toy encoder has {heads} heads, not divisible by degree {degree}"]
        return []

    def preprocess(self, media: list[Any]) -> dict[str, torch.Tensor]:
        items = [torch.as_tensor(m, dtype=torch.float32) for m in media]
        return {"patches": torch.cat(items), "sizes": torch.tensor([len(i) for i in items])}

    def num_tokens(self, inputs: dict[str, torch.Tensor]) -> list[int]:
        return inputs["sizes"].tolist()

    def encode(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        device = next(module.parameters()).device
        items = inputs["patches"].to(device).split(inputs["sizes"].tolist())
        return torch.cat([module(x) for x in items])

    def hidden_size(self) -> int:
        return ToyEncoderConfig.from_pretrained(self.path).out_hidden

    def layer_map(self) -> LayerMap:
        return LayerMap(
            column=("block.qkv", "block.up"), row=("block.proj", "block.down"), heads={"block": ("heads",)}
        )

    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(state)

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None, seed: int = 0, **kw: Any) -> Path:
        torch.manual_seed(seed)
        ToyEncoder(ToyEncoderConfig(**kw)).save_pretrained(out_dir)
        return Path(out_dir)


class ToyLMFamily(LanguageFamily):
    name: ClassVar[str] = "toy"

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        return ToyLM.from_pretrained(self.path, torch_dtype=dtype)

    def _config(self) -> ToyLMConfig:
        if not hasattr(self, "_cfg"):
            self._cfg = ToyLMConfig.from_pretrained(self.path)
        return self._cfg

    def placeholder_token_id(self, module: str) -> int:
        cfg = self._config()
        return {"vision": cfg.image_token_id, "audio": cfg.audio_token_id}[module]

    def forward(self, module, inputs, embeds):
        device = module.embed.weight.device
        length = max(len(x["input_ids"]) for x in inputs)
        rows, labels = [], []
        for x, e in zip(inputs, embeds):
            ids = x["input_ids"].to(device)
            h = module.embed(ids)
            for mod, value in e.items():
                mask = ids == self.placeholder_token_id(mod)
                # index_put keeps the graph to the encoder rows (no in-place on a leaf)
                h = h.index_put((mask.nonzero()[:, 0],), value.to(h.dtype))
            pad = length - len(ids)
            rows.append(F.pad(h, (0, 0, 0, pad)))
            labels.append(F.pad(x["labels"].to(device), (0, pad), value=-100))
        logits = module(torch.stack(rows))
        lab = torch.stack(labels)
        return logits[:, :-1].reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1)

    def layer_map(self) -> LayerMap:
        return LayerMap(
            column=("blocks.*.qkv", "blocks.*.up"),
            row=("blocks.*.proj", "blocks.*.down"),
            vocab=("embed",),
            output=("lm_head",),
            heads={"blocks.*": ("heads",)},
        )

    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(state)

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None, seed: int = 0, **kw: Any) -> Path:
        torch.manual_seed(seed + 1)
        ToyLM(ToyLMConfig(**kw)).save_pretrained(out_dir)
        return Path(out_dir)


@hookimpl
def disagg_register_families(register: Callable[[type], None]) -> None:
    register(ToyEncoderFamily)
    register(ToyLMFamily)


def make_toy_dirs(root: Path, seed: int = 0, **lm_kw: Any) -> tuple[Path, Path]:
    """Write a toy encoder dir and a toy LM dir under ``root``."""
    enc = ToyEncoderFamily.make_tiny(Path(root) / "toy_encoder", seed=seed)
    lm = ToyLMFamily.make_tiny(Path(root) / "toy_lm", seed=seed, **lm_kw)
    return enc, lm


def toy_samples(
    n: int, seed: int = 0, in_dim: int = 6, vocab: int = 40, image_token_id: int = 3, text_only_every: int = 0
) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Synthetic ragged samples: some images (1-2 items of 2-5 patches), text with
    the right number of placeholders, labels on the second half of the text."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        text_only = bool(text_only_every) and i % text_only_every == text_only_every - 1
        n_items = 0 if text_only else int(torch.randint(1, 3, (1,), generator=g))
        sizes = [int(torch.randint(2, 6, (1,), generator=g)) for _ in range(n_items)]
        prompt = torch.randint(5, vocab, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g)
        answer = torch.randint(5, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        ids = torch.cat([torch.full((sum(sizes),), image_token_id), prompt, answer])
        labels = torch.full_like(ids, -100)
        labels[-len(answer) :] = answer
        sample = {"llm": {"input_ids": ids, "labels": labels}}
        if n_items:
            sample["vision"] = ToyEncoderFamily.preprocess(
                None,
                [torch.randn(s, in_dim, generator=g) for s in sizes],  # type: ignore[arg-type]
            )
        out.append(sample)
    return out


def put_samples(samples: list[dict[str, dict[str, torch.Tensor]]], start: int = 0) -> list[Any]:
    """Put toy samples into the Ray object store as ``SampleRefs`` (driver keeps refs only)."""
    import ray

    from disagg.data.types import SampleRefs

    out = []
    for i, s in enumerate(samples):
        out.append(
            SampleRefs(
                index=start + i,
                inputs={m: ray.put(d) for m, d in s.items()},
                # the first token is never predicted (labels are shifted by one)
                num_label_tokens=int((s["llm"]["labels"][1:] != -100).sum()),
                num_tokens=int(s["llm"]["input_ids"].numel()),
                source=f"toy:{start + i}",
            )
        )
    return out


class ToyDataSource:
    """A deterministic stream of toy batches (a ``DataSource``), resumable by step."""

    def __init__(self, batch_size: int, seed: int = 0, text_only_every: int = 4):
        self.batch_size, self.seed, self.text_only_every = batch_size, seed, text_only_every

    def batch(self, step: int) -> list[dict[str, dict[str, torch.Tensor]]]:
        return toy_samples(self.batch_size, seed=self.seed + step, text_only_every=self.text_only_every)

    def batches(self, start_step: int = 0):
        step = start_step
        while True:
            yield put_samples(self.batch(step), start=step * self.batch_size)
            step += 1

    def stats(self) -> dict[str, int]:
        return {"skipped": 0, "dropped_too_long": 0}
