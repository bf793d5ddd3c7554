"""``disagg export`` of modules trained with LoRA (``train.modules.<m>.lora``).

A LoRA module's checkpoint holds its adapters and ``modules_to_save`` parts
only (in the full form or as sharded pieces). Exported, it becomes either

- a PEFT adapter dir, ``OUT_DIR/adapters/<module>/`` (``adapter_config.json``
  and ``adapter_model.safetensors``), whose base is the exported HF dir (which
  then holds the module's base weights as the source dir has them):
  ``PeftModel.from_pretrained(Model.from_pretrained(HF dir), adapter dir)``
  gives the trained model; or
- with ``--merge``, merged weights in the HF dir itself (``W + alpha/r * B A``
  per adapted linear, the saved parts as trained), which ``from_pretrained``
  loads like any full export, whatever layout trained it (the checkpoint is
  layout-free).

Merged weights go through the family's ``export_state`` as a full export's
do. The adapter dir names the modules of the HF model class that loads the HF
dir (the whole VLM for a tower of one), as PEFT sees them in memory:
``target_modules`` and ``modules_to_save`` are those full names, never
suffixes that could match another module.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from disagg.config.schema import Config
from disagg.interfaces import Family
from disagg.interfaces.lora import ADAPTER, LoraSpec
from disagg.kit.lora import is_adapter_param, peft_config
from disagg.runtime.hf_shards import Entry

ADAPTERS = "adapters"
#: the prefix PEFT's saved adapter files put before the base model's names
PEFT_PREFIX = "base_model.model."


def lora_specs(cfg: Config, families: dict[str, Family]) -> dict[str, LoraSpec]:
    """The modules of ``cfg`` trained with LoRA, and their resolved specs."""
    from disagg.runtime.plan import optim_for

    out = {}
    for m, fam in families.items():
        optim = optim_for(cfg, m, fam)
        if optim is not None and optim.lora is not None:
            out[m] = optim.lora
    return out


def _mapped(family: Family, names: list[str]) -> dict[str, str]:
    """Module-local tensor name -> the name the family exports it under (no values read)."""
    stand_ins = {n: torch.empty(0, device="meta") for n in names}
    back = {id(t): n for n, t in stand_ins.items()}
    return {back[id(t)]: out for out, t in family.export_state(stand_ins).items()}


def _adapted(state: dict[str, torch.Tensor]) -> list[str]:
    """Module-local names of the linears the adapters wrap (``...q_proj``)."""
    return sorted({k.split(".lora_A.")[0] for k in state if ".lora_A." in k})


def hf_module_names(hf_dir: Path) -> list[str]:
    """Module names of the HF model class that loads ``hf_dir`` (its ``config.json``'s
    architecture), built on the meta device: no weight is read. PEFT names adapters by
    these in-memory names, which a dir's files need not use (legacy key layouts)."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise ValueError(f"{hf_dir}/config.json names no transformers architecture ({arch!r}) to load")
    with torch.device("meta"):
        model = cls(config)
    return [n for n, _ in model.named_modules() if n]


def _full_name(local: str, names: list[str], hf_dir: Path) -> str:
    """The one module of the HF model that ``local`` (a name in the family's module) is:
    the same name, or the only one ending in it."""
    hits = [n for n in names if n == local or n.endswith("." + local)]
    if len(hits) != 1:
        found = ", ".join(hits[:4]) if hits else "none"
        raise ValueError(f"module {local!r} is not one module of the model in {hf_dir} (matches: {found})")
    return hits[0]


def trained_state(full: Path) -> dict[str, torch.Tensor]:
    """A LoRA module's trained tensors (small: adapters and ``modules_to_save`` parts) from
    its checkpoint, ``full`` (``<module>/full.safetensors``) or the sharded pieces beside
    where it would be, each tensor whole."""
    from disagg.runtime.actor.state import read_module_state

    return read_module_state(full.parent.parent, full.parent.name)[0]


def write_adapter_dir(family: Family, full: Path, spec: LoraSpec, dest: Path, base_dir: Path) -> Path:
    """``dest``: a PEFT adapter dir of the module's trained tensors (``full``) over ``base_dir``."""
    state = trained_state(full)
    names = hf_module_names(base_dir)
    adapted = {m: _full_name(m, names, base_dir) for m in _adapted(state)}
    saved = {m: _full_name(m, names, base_dir) for m in spec.modules_to_save}
    tensors = {}
    for k, v in state.items():
        if is_adapter_param(k):  # PEFT saves adapter weights without the adapter's name
            module, _, rest = k.partition(".lora_")
            name = f"{adapted[module]}.lora_{rest.replace('.' + ADAPTER + '.', '.', 1)}"
        else:
            part = next((m for m in saved if k.startswith(m + ".")), None)
            if part is None:
                raise KeyError(f"{full}: {k!r} is neither an adapter nor in modules_to_save {list(saved)}")
            name = saved[part] + k[len(part) :]
        tensors[PEFT_PREFIX + name] = v.contiguous()
    config = peft_config(spec)
    config.target_modules = sorted(adapted.values())
    config.modules_to_save = sorted(saved.values()) or None
    config.base_model_name_or_path = str(Path(base_dir).resolve())
    dest.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(dest))
    save_file(tensors, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dest


def merged_entries(family: Family, full: Path, spec: LoraSpec, source: dict[str, Entry]) -> dict[str, Entry]:
    """The HF dir's tensors that merging changes: each adapted linear's weight
    ``W + (alpha / r) * B @ A`` (``W`` read from the source dir's file, as PEFT's
    ``merge_and_unload`` adds it, in fp32) and the ``modules_to_save`` parts as trained."""
    from safetensors import safe_open

    from disagg.runtime.hf_shards import TensorRef

    state = trained_state(full)
    adapted = _adapted(state)
    names = _mapped(family, [f"{m}.weight" for m in adapted] + [k for k in state if not is_adapter_param(k)])
    scaling = spec.alpha / spec.r
    out: dict[str, Entry] = {}
    for m in adapted:
        key = names[f"{m}.weight"]
        ref = source.get(key)
        if not isinstance(ref, TensorRef):
            raise KeyError(f"--merge: the source dir has no tensor {key!r} for the adapted linear {m!r}")
        with safe_open(str(ref.file), framework="pt") as fh:
            base = fh.get_tensor(ref.key).to(torch.float32)
        a, b = state[f"{m}.lora_A.default.weight"], state[f"{m}.lora_B.default.weight"]
        out[key] = base + (b @ a) * scaling
    for k, v in state.items():
        if not is_adapter_param(k):
            out[names[k]] = v
    return out
