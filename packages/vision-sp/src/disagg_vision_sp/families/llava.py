"""``llava`` vision family: a LLaVA dir's SigLIP or CLIP (llava-1.5) vision
tower + MLP ``multi_modal_projector``.

``encode`` is ``LlavaModel.get_image_features`` for one sample (an int
``vision_feature_layer``). Under ``ulysses`` every image is one full-attention
segment of the concatenated sequence, so every layer's attention spans shards
and cuts may fall on any token. A CLIP tower prepends a CLS token to each
image; with ``vision_feature_select_strategy: default`` (llava-1.5) its row
never reaches the LLM: the layout marks it dropped (``row_sample`` -1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from disagg.interfaces import AttentionScope, LayerMap, SeqLayout
from disagg.kit.hf import check_attn_implementation
from disagg_vision_sp.families.common import TowerProjectorFamily, image_processor, load_image

_TOWERS = ("siglip_vision_model", "clip_vision_model")


def _encoder_class() -> type:
    """The module ``build`` returns: LLaVA minus its language model, loadable
    with ``from_pretrained`` from a whole LLaVA dir (other tensors are skipped)."""
    from transformers import AutoModel
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector, LlavaPreTrainedModel

    class LlavaVisionEncoder(LlavaPreTrainedModel):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.vision_tower = AutoModel.from_config(config.vision_config)
            self.multi_modal_projector = LlavaMultiModalProjector(config)
            self.post_init()

    return LlavaVisionEncoder


class LlavaVision(TowerProjectorFamily):
    """Options: ``attn_implementation`` (sdpa | eager | flash_attention_2)."""

    name: ClassVar[str] = "llava"
    encoder_class = staticmethod(_encoder_class)

    @classmethod
    def planning_shape(cls, config, options=None, llm_hidden=None):  # type: ignore[no-untyped-def]
        from disagg_vision_sp.families.shapes import llava_shape

        return llava_shape(config)

    # -- config ---------------------------------------------------------------------------------
    def _feature_layers(self) -> int:
        """Tower layers that run: LLaVA reads ``hidden_states[vision_feature_layer]``
        (index 0 = embeddings), so later layers never influence the output."""
        cfg = self.config()
        layer = cfg.vision_feature_layer
        n = cfg.vision_config.num_hidden_layers
        return layer if layer >= 0 else n + 1 + layer

    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        problems = check_attn_implementation(self.options, "vision")
        cfg = self.config()
        if cfg.vision_config.model_type not in _TOWERS:
            problems.append(
                f"model.vision.path={str(self.path)!r}: vision tower {cfg.vision_config.model_type!r} is not "
                f"supported by family 'llava'; allowed: {', '.join(_TOWERS)}"
            )
        if not isinstance(cfg.vision_feature_layer, int):
            problems.append(
                f"vision_feature_layer={cfg.vision_feature_layer!r} in {self.path}/config.json: "
                "family 'llava' "
                "supports one int layer only"
            )
        strategy = cfg.vision_feature_select_strategy
        allowed = ("full", "default") if self._has_cls() else ("full",)
        if strategy not in allowed:
            # 'default' drops the first token: a CLS for CLIP, an image patch for SigLIP (no CLS).
            problems.append(
                f"vision_feature_select_strategy={strategy!r} in {self.path}/config.json: family 'llava' "
                f"with a {cfg.vision_config.model_type!r} tower supports {' or '.join(map(repr, allowed))}"
            )
        return problems

    def _has_cls(self) -> bool:
        """CLIP towers prepend a CLS token to every image (and norm before the layers)."""
        return self.config().vision_config.model_type == "clip_vision_model"

    def _drops_cls(self) -> bool:
        return self._has_cls() and self.config().vision_feature_select_strategy == "default"

    # -- building (build, build_empty, checkpoint_name, parts: TowerProjectorFamily) ------------
    def layer_map(self) -> LayerMap:
        layers = "vision_tower.encoder.layers.*"
        return LayerMap(
            column=(
                f"{layers}.self_attn.q_proj",
                f"{layers}.self_attn.k_proj",
                f"{layers}.self_attn.v_proj",
                f"{layers}.mlp.fc1",
                "multi_modal_projector.linear_1",
            ),
            row=(f"{layers}.self_attn.out_proj", f"{layers}.mlp.fc2", "multi_modal_projector.linear_2"),
            heads={f"{layers}.self_attn": ("num_heads",)},
            # Full copies on every TP rank: embeddings, norms, and the parts LLaVA
            # never runs (post-layernorm, a pooling head when the tower has one).
            replicated=(
                "vision_tower.embeddings.*",
                "vision_tower.pre_layrnorm.*",
                f"{layers}.layer_norm1.*",
                f"{layers}.layer_norm2.*",
                "vision_tower.post_layernorm.*",
                "vision_tower.head.*",
            ),
            # each layer's fc1 -> activation -> fc2 reads layer_norm2's output only (mlp_tiles)
            mlp={f"{layers}.mlp": "layer_norm2"},
        )

    @classmethod
    def make_tiny(cls, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
        from disagg_vision_sp.families.tiny_llava import make_tiny_llava

        return make_tiny_llava(Path(out_dir))

    @classmethod
    def tiny_variants(cls) -> dict[str, Any]:
        from disagg_vision_sp.families.tiny_llava import make_tiny_llava

        # llava-1.5's layout: a CLIP tower whose CLS row is dropped from the features
        return {"llava_clip": lambda out: make_tiny_llava(Path(out), tower="clip")}

    # -- data -----------------------------------------------------------------------------------
    def preprocess(self, media: list[Any]) -> dict[str, torch.Tensor]:
        proc = image_processor(str(self.path))
        out = proc(images=[load_image(m) for m in media], return_tensors="pt")
        return {"pixel_values": out["pixel_values"].to(torch.float32)}

    def _patches(self) -> int:
        v = self.config().vision_config
        return (v.image_size // v.patch_size) ** 2

    def _tower_tokens(self) -> int:
        """Tokens of one image inside the tower (CLS included)."""
        return self._patches() + int(self._has_cls())

    def num_tokens(self, inputs: dict[str, torch.Tensor]) -> list[int]:
        per = self._tower_tokens() - int(self._drops_cls())
        return [per] * int(inputs["pixel_values"].shape[0])

    def encode(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = inputs["pixel_values"].to(module.device, module.dtype)
        out = module.vision_tower(pixels, output_hidden_states=True, return_dict=True)
        features = out.hidden_states[self.config().vision_feature_layer]
        if self._drops_cls():
            features = features[:, 1:]
        return module.multi_modal_projector(features).reshape(-1, self.hidden_size())

    # -- ulysses hook points --------------------------------------------------------------------
    def ulysses_heads(self) -> int:
        return int(self.config().vision_config.num_attention_heads)

    def ulysses_layout(self, inputs: list[dict[str, torch.Tensor]]) -> SeqLayout:
        per_image = self._tower_tokens()
        images = [int(x["pixel_values"].shape[0]) for x in inputs]
        n = sum(images) * per_image
        row_sample = torch.repeat_interleave(torch.arange(len(inputs)), torch.tensor(images) * per_image)
        # each token's index inside its image, and, counting kept tokens only, inside its sample
        in_image = torch.arange(n) % per_image
        kept = torch.ones(n, dtype=torch.bool)
        if self._drops_cls():
            kept = in_image != 0
            row_sample = torch.where(kept, row_sample, -1)  # the CLS row never reaches the LLM
        sample_rows = [sum(self.num_tokens(x)) for x in inputs]
        row_pos = torch.zeros(n, dtype=torch.long)
        for s in range(len(inputs)):
            mine = row_sample == s
            row_pos[mine] = torch.arange(int(mine.sum()))
        return SeqLayout(
            n_tokens=n,
            cuts=list(range(n + 1)),
            unit=1,
            row_sample=row_sample,
            row_pos=row_pos,
            sample_rows=sample_rows,
            extra={"segments": [per_image] * (n // per_image), "per_image": per_image},
        )

    def ulysses_forward(
        self,
        module: nn.Module,
        inputs: list[dict[str, torch.Tensor]],
        layout: SeqLayout,
        lo: int,
        hi: int,
        scope: AttentionScope,
    ) -> torch.Tensor:
        p = layout.extra["per_image"]
        first, last = lo // p, -(-hi // p)  # images overlapping [lo, hi)
        pixels = torch.cat([x["pixel_values"] for x in inputs])[first:last].to(module.device, module.dtype)
        tower = module.vision_tower
        # Patch + position embeddings (and CLIP's pre-norm) are per token: embed the
        # overlapping images, keep our tokens.
        hidden = tower.embeddings(pixels)
        if self._has_cls():
            hidden = tower.pre_layrnorm(hidden)
        hidden = hidden.reshape(-1, tower.config.hidden_size)[lo - first * p : hi - first * p].unsqueeze(0)
        for layer in tower.encoder.layers[: self._feature_layers()]:
            with scope.spanning(layout.extra["segments"]):
                hidden = layer(hidden, None)
        return module.multi_modal_projector(hidden[0])
