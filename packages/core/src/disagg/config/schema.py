"""The run configuration: one YAML file, validated before any actor starts.

Each field's docstring is the config reference (docs/configuration.md renders the same text).
Unknown keys are rejected everywhere except ``parallel.<module>``, whose extra
keys belong to the chosen strategy and are validated by its options model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator

from disagg.interfaces.strategy import DEFAULT_CHUNK_TOKENS

MODULES = ("vision", "audio", "llm")

#: keys a config may still carry from an older release: (section, key) -> what replaces it
RENAMED_KEYS: dict[tuple[str, str], str] = {
    ("train", "dtype"): "replaced by train.precision (float32 -> fp32, bfloat16 -> bf16, "
    "auto -> auto; bf16-pure is new: bf16 weights, gradients and AdamW state)",
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ModuleModel(Strict):
    family: str
    """Family adapter name (see ``disagg plugins``), e.g. ``qwen2_5_vl``, ``qwen2``, ``llama``."""
    path: str
    """Hugging Face dir to load with ``from_pretrained``, or a Hub model id (``Qwen/Qwen2.5-VL-7B-Instruct``,
    ``org/name@revision``) resolved once on the driver through the hub cache (``HF_HOME``,
    ``HF_HUB_OFFLINE``, ``HF_TOKEN``) to its snapshot dir; whole-VLM dirs are split by family."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Family options, e.g. ``{attn_implementation: sdpa}``."""


class ModelConfig(Strict):
    vision: ModuleModel | None = None
    """The vision encoder (projector included)."""
    audio: ModuleModel | None = None
    """The audio encoder (projector included)."""
    llm: ModuleModel
    """The language model. Required."""


class Resources(Strict):
    num_cpus: float = Field(1.0, ge=0)
    """Logical CPUs each rank's actor reserves."""
    num_gpus: float | None = Field(None, ge=0)
    """GPUs per rank, on CUDA; default 1 (disaggregated: whole GPUs only) or, collocated, an even
    split of the GPU the ranks of one index share (what explicit shares leave; they may sum to
    at most 1). 0 is refused on CUDA."""


class GroupConfig(BaseModel):
    """``parallel.<module>``: the module's strategy and mesh; extra keys are strategy options."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    strategy: str = "ddp"
    """Strategy name (``ddp``, ``ulysses``, ``megatron_tp``, ``zero`` or a third party's)."""
    degree: PositiveInt = 1
    """Ranks that share the same samples (SP or TP size)."""
    replicas: PositiveInt = 1
    """Data-parallel copies; the group has ``degree * context_parallel * replicas`` ranks."""
    context_parallel: PositiveInt = 1
    """``parallel.llm`` only: ranks of one replica that split every sample's sequence
    (context parallelism, load-balanced for causal attention; attention all-gathers the
    keys and values over them); the strategy must support it (``ddp``, ``megatron_tp``)."""
    ranks: PositiveInt | None = None
    """Optional cross-check: when set, must equal ``degree * context_parallel * replicas``."""
    resources: Resources = Field(default_factory=Resources)
    """Ray resources per rank."""
    recompute: Literal["none", "full", "selective"] = "none"
    """Activation recomputation: ``full`` keeps only each transformer block's input and
    runs its forward again in backward; ``selective`` recomputes only the attention core
    (scores, softmax, context). Each strategy applies it; one that cannot is refused
    with the values it allows."""
    loss_chunk_tokens: PositiveInt | None = DEFAULT_CHUNK_TOKENS
    """``parallel.llm`` only: the loss applies the output head to this many tokens at a time
    inside a recomputed region, so one chunk's logits (tokens x vocabulary, fp32) exist at
    once, in forward and in backward, whatever the sequence length; the same loss and
    gradients. ``null``: the whole microbatch's logits at once, as Hugging Face does."""
    offload: Literal["none", "optimizer", "activations", "all"] = "none"
    """``optimizer``: the optimizer's state in host memory (pinned on CUDA) between steps: the
    masters the optimizer steps, the step's gradient sums and the AdamW moments; AdamW runs on
    the host and only the working weights stay on the device (``zero``: DeepSpeed's
    ``offload_optimizer``). Not with ``overlap_grad_reduce``. ``activations`` (needs
    ``recompute: full``): the input each recomputed block keeps goes to pinned host memory at
    its forward and comes back for its replay (torch's ``save_on_cpu``). ``all``: both."""
    mlp_tiles: PositiveInt | Literal["auto"] = 1
    """Each block's MLP runs over the sequence in this many tiles, each recomputed in its
    backward, so one tile's MLP intermediates exist at a time instead of every token's
    (sequence-tiled MLP, as Arctic Long Sequence Training); the same loss and gradients up to
    summation order, one more forward of the MLPs. ``auto``: ``ceil(tokens / hidden)``, a tile
    of about ``hidden`` rows. ``1``: off. Strategies ``ddp``, ``ulysses``, ``megatron_tp``;
    the family must declare its MLP modules."""
    feature_cache: Literal["none", "host", "disk"] = "none"
    """A frozen encoder (``train.modules.<m>.freeze: true``) as a feature service: each
    sample's output (the exact tensors the LLM receives) is kept under a key of the sample's
    media as preprocessed, the preprocessing settings, the module's weights, family and
    precision, and a later step with the same key skips the encoder. ``host``: the Ray
    object store (host memory), least recently used entries evicted past
    ``feature_cache_gb``; ``disk``: files under ``feature_cache_dir``, reused by a resumed
    or repeated run. Training steps only (evaluation runs the encoder)."""
    feature_cache_gb: float = Field(4.0, gt=0)
    """Most gigabytes (1e9 bytes) the feature cache holds; least recently used entries go first."""
    feature_cache_dir: str | None = None
    """``feature_cache: disk``: the dir of the entries (every node must see it); default
    ``<output_dir>/feature_cache/<module>``."""
    feature_cache_ahead: int = Field(0, ge=0, le=8)
    """With a feature cache: the encoder works through the next this many global batches into
    the cache while the LLM trains on the current one, so that the LLM finds them cached and never
    waits for the encoder (0: only the current batch; each batch ahead holds its outputs in the
    cache a step earlier)."""

    @field_validator("mlp_tiles", mode="before")
    @classmethod
    def _tiles(cls, v: Any) -> Any:
        # one message for the union (pydantic would report each of its members apart)
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError(f"{v!r} is not a number of tiles; allowed: a positive integer (1: off) or 'auto'")

    def strategy_options(self) -> dict[str, Any]:
        """The strategy's own keys, plus core's keys applied by the strategy (``recompute``,
        ``loss_chunk_tokens``, ``offload``, ``mlp_tiles``)."""
        return {
            **(self.model_extra or {}),
            "recompute": self.recompute,
            "loss_chunk_tokens": self.loss_chunk_tokens,
            **({"offload": self.offload} if self.offload != "none" else {}),
            **({"mlp_tiles": self.mlp_tiles} if self.mlp_tiles != 1 else {}),
        }


class AutoPlan(Strict):
    """``parallel: auto`` (or ``parallel.auto: {...}``): ``disagg train`` runs ``disagg plan``
    first and trains its best layout; the choice is recorded in the run dir (``plan.json``)."""

    cluster: str | None = None
    """Cluster preset (``h100x8``, ``h200x8``, ``cpu``; ``cpu-local``: ``cpu`` measured on
    this machine) or a JSON file from ``disagg plan --calibrate FILE``; default: the
    Ray cluster's devices."""
    vision_tokens: PositiveInt | None = None
    """Vision tokens per sample the plan assumes: the merged rows the LLM sees, as
    ``disagg data check`` prints them; default: the most one image gives under
    ``data.max_pixels``, else 1024 patches' worth."""
    text_tokens: PositiveInt = 128
    """Text tokens per sample the plan assumes."""
    recompute: bool = False
    """Only plan layouts that recompute activations (``parallel.<m>.recompute``) where the
    module's strategy can; otherwise the planner searches ``recompute`` per module and the
    layout it trains carries the chosen value."""
    placement: Literal["any", "collocated", "disaggregated"] = "any"
    """Placements the plan may choose."""
    strategies: list[str] | None = None
    """Strategies the plan may choose (default: every installed one that reports its cost)."""


class ParallelConfig(Strict):
    placement: Literal["collocated", "disaggregated"] = "collocated"
    """``collocated``: groups share devices (fractional GPUs); ``disaggregated``: each group
    its own devices, on its own node when the cluster has several."""
    transport: str = "auto"
    """``auto``: ``object_store`` on CPU; on CUDA ``cuda_ipc`` when every group has one rank on
    one shared GPU (collocated), ``nccl`` between disaggregated groups when cupy is installed
    (``pip install 'disagg-core[nccl]'``), else ``object_store``. Or name one: ``object_store``
    (any layout), ``cuda_ipc``, ``nccl`` or a plugin's; one that cannot work in the layout
    (e.g. ``nccl`` with collocated groups sharing a GPU) is refused with the reason."""
    assign: Literal["balanced", "contiguous"] = "balanced"
    """How a microbatch's samples are split over a group's replicas: ``balanced`` evens out
    each replica's tokens (vision patches for an encoder, all tokens for the LLM) so no
    replica waits for a heavier one; ``contiguous`` slices in order. The math is the same."""
    collective_timeout_s: float = Field(600.0, gt=0)
    """Longest a rank waits in one collective for the other ranks of its group; past it the
    run stops with an error naming the module, the ranks and the step (never a silent hang)."""
    start_timeout_s: float = Field(900.0, gt=0)
    """Longest the driver waits for the groups' actors to be placed on the cluster and set up
    (weights loaded, ``torch.distributed`` joined); past it the run stops naming the module, the
    ranks and the resources they asked for."""
    vision: GroupConfig = Field(default_factory=GroupConfig)
    """The vision encoder's group (ignored unless ``model.vision`` is set)."""
    audio: GroupConfig = Field(default_factory=GroupConfig)
    """The audio encoder's group (ignored unless ``model.audio`` is set)."""
    llm: GroupConfig = Field(default_factory=GroupConfig)
    """The language model's group."""
    auto: AutoPlan | None = None
    """Choose the groups, placement and microbatches with the planner (``parallel: auto``)."""


DataFormat = Literal["auto", "llava", "sharegpt", "alpaca", "query_response", "hf"]


class DatasetEntry(Strict):
    path: str
    """A JSON/JSONL file, a ``.parquet`` file, or a Hugging Face dataset dir (``save_to_disk``
    output or a dir of parquet files)."""
    weight: float = Field(1.0, gt=0)
    """Relative sampling weight when several datasets are mixed."""
    media_root: str | None = None
    """Dir media paths are relative to; default ``data.media_root``."""
    format: DataFormat | None = None
    """Row format of this dataset; default ``data.format``."""


class DataConfig(Strict):
    train: str | list[DatasetEntry]
    """One dataset path, or a list of ``{path, weight, media_root}``; with ``dataset_dir``, a
    dataset's name in its ``dataset_info.json`` (a list entry's ``path`` is a name)."""
    eval: str | None = None
    """Held-out dataset for evaluation (a name with ``dataset_dir``)."""
    dataset_dir: str | None = None
    """A LLaMA-Factory data dir: ``train``/``eval`` name entries of its ``dataset_info.json``
    (``file_name``, ``formatting``: ``alpaca`` or ``sharegpt``, ``columns``, ``tags``), read as
    LLaMA-Factory reads them; media paths are relative to it unless ``media_root`` is set."""
    media_root: str = "."
    """Dir that media paths in the datasets are relative to."""
    format: DataFormat = "auto"
    """Row format: ``llava`` (``conversations`` + ``image``/``audio``), ``sharegpt``
    (LLaMA-Factory / ms-swift: ``messages`` + ``images``/``audios``, optional ``system``),
    ``alpaca`` (``instruction``/``input``/``output`` + ``images``, optional ``system``,
    ``history``), ``query_response`` (ms-swift: ``query``/``response``/``history`` +
    ``images``/``audios``), ``hf`` (a Hugging Face dataset dir or parquet whose rows are any
    of these), or ``auto`` (a dir or parquet is ``hf``; the row format is detected from the
    first rows' keys)."""
    min_pixels: PositiveInt | None = None
    """Smallest image area the image processor resizes to (Qwen2.5-VL style processors);
    ``null``: the processor's own setting."""
    max_pixels: PositiveInt | None = None
    """Largest image area the image processor resizes to, which bounds vision tokens per image
    (Qwen2.5-VL: one token per 28x28 pixels); ``null``: the processor's own setting."""
    video_fps: PositiveFloat = 2.0
    """Frames sampled per second of video (Qwen's ``fps``; qwen-vl-utils' default 2); the
    count is then bounded by ``video_max_frames`` and rounded down to the tower's temporal
    patch (docs/data.md, Video)."""
    video_max_frames: PositiveInt = 768
    """Most frames sampled from one video (qwen-vl-utils' ``FPS_MAX_FRAMES``)."""
    video_min_pixels: PositiveInt | None = None
    """Smallest area each video frame is resized to; ``null``: the family's default
    (Qwen2.5-VL: 128*28*28, as transformers' and qwen-vl-utils' video processing). Qwen3-VL:
    over all the video's frames (its processor's ``size.shortest_edge``, 128*32*32)."""
    video_max_pixels: PositiveInt | None = None
    """Largest area each video frame is resized to, which bounds tokens per frame pair
    (Qwen2.5-VL: one token per 28x28 pixels per 2 frames); ``null``: the family's default
    (768*28*28). Qwen3-VL: over all the video's frames (``size.longest_edge``, 768*32*32)."""
    batch_size: PositiveInt = 4
    """Samples per optimizer step (the global batch)."""
    max_tokens: PositiveInt | None = None
    """Longest tokenized sample; see ``on_too_long``."""
    on_too_long: Literal["error", "drop", "truncate"] = "error"
    """A sample longer than ``max_tokens``: ``error`` stops with its file/line, ``drop`` skips
    it (counted as ``dropped_too_long``), ``truncate`` cuts its tokens to ``max_tokens``
    (counted as ``truncated_too_long``; refused, as an error, when the cut would fall inside or
    before an image's or audio's placeholder tokens)."""
    on_error: Literal["error", "skip"] = "error"
    """Bad sample (missing media, bad placeholders...): stop with its file/line, or skip and count it."""
    num_workers: PositiveInt = 2
    """Parallel Ray preprocessing tasks."""
    shuffle: bool = True
    """Shuffle sample order each epoch (deterministic for ``train.seed``)."""
    group_by_length: bool = False
    """Put samples of similar token count in the same global batch (less padding, even
    replicas for long-tailed image sizes): each window of 8 batches' samples is sorted by
    tokens, cut into batches, and their order shuffled per ``train.seed``."""


class PartTrainConfig(Strict):
    """``train.modules.<m>.param_groups.<part>``: settings for one part of the module."""

    lr: float | None = Field(None, gt=0)
    """Learning rate of the part's parameters (default: the module's); the module's
    scheduler scales it like the module's."""
    weight_decay: float | None = Field(None, ge=0)
    """Weight decay of the part's parameters (default: the module's)."""


class LoraTrainConfig(Strict):
    """``train.modules.<m>.lora``: train PEFT LoRA adapters on the module's linears instead of
    its weights (``pip install 'disagg-core[lora]'``). The base weights are frozen (no gradient,
    no optimizer state); the adapters and ``modules_to_save`` train."""

    r: int = 8
    """Rank of each adapter (PEFT ``r``), > 0."""
    alpha: float = Field(16.0, gt=0)
    """Scaling numerator (PEFT ``lora_alpha``): the adapter's output is scaled by ``alpha / r``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (PEFT ``lora_dropout``), drawn like the module's own dropout."""
    targets: list[str] = Field(min_length=1)
    """Linear layers to adapt, as PEFT's ``target_modules`` list: a module's full name or a suffix
    of whole components, e.g. ``[q_proj, v_proj]`` on an LLM, ``[attn.qkv, attn.proj]`` on the
    Qwen2.5-VL tower (docs/models.md lists each family's linears). One that matches none of the
    family's linears is refused."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Family part names trained in full beside the adapters (PEFT ``modules_to_save``), e.g.
    ``[merger]`` on ``qwen2_5_vl`` vision."""


class ModuleTrainConfig(Strict):
    freeze: bool | list[str] = False
    """``true``: the whole module is frozen: no optimizer, no parameter gradients, and a frozen
    encoder runs forward only (ahead of the LLM under ``encoders_ahead``); gradients still flow
    through a frozen LLM to upstream encoders. A list of the family's part names (docs/models.md
    lists them; an unknown one is answered with them), e.g. ``[tower]`` on ``qwen2_5_vl``
    vision keeps the merger trainable: those parameters get no gradient and no optimizer
    state; the rest train."""
    param_groups: dict[str, PartTrainConfig] = Field(default_factory=dict)
    """Per-part optimizer settings, keyed by the family's part names, e.g.
    ``{merger: {lr: 1.0e-3}}``; parts not named use the module's. A parameter in several
    named parts takes the first listed."""
    lr: float | None = Field(None, gt=0)
    """Overrides ``train.lr`` for this module."""
    weight_decay: float | None = Field(None, ge=0)
    """Overrides ``train.weight_decay`` for this module."""
    scheduler: str | None = None
    """Overrides ``train.scheduler`` for this module."""
    warmup_steps: int | None = Field(None, ge=0)
    """Overrides ``train.warmup_steps`` for this module."""
    lora: LoraTrainConfig | None = None
    """Train LoRA adapters instead of the module's weights (``null``: full training)."""


class TrainConfig(Strict):
    steps: PositiveInt = 10
    """Optimizer steps. Set this or ``epochs``, not both."""
    epochs: float | None = Field(None, gt=0)
    """Passes over the training data, instead of ``steps``: the run takes
    ceil(epochs x samples / ``data.batch_size``) steps, samples counted over every
    ``data.train`` dataset when the run starts (with several weighted datasets an epoch is
    that many samples drawn by weight). Fractions are allowed (``0.5``)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate on the whole ``data.eval`` set every N steps (0: only after the last step;
    with ``data.eval`` set the last step is always evaluated): eval mode, the train loss's
    normalisation (sum over label tokens / the set's label tokens); ``eval_*`` in metrics."""
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    scheduler: str = "constant"
    """Any ``transformers.get_scheduler`` kind: constant, linear, cosine, constant_with_warmup, ..."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps of the scheduler."""
    microbatches: PositiveInt = 1
    """Gradient accumulation: the global batch is split into this many microbatches."""
    schedule: str = "sequential"
    """Order of microbatch phases across groups: ``sequential`` (forward, LLM, backward per
    microbatch) or ``encoders_ahead`` (encoders run forward on k+1.. while the LLM works on k),
    or a plugin's (see ``disagg plugins``)."""
    max_inflight: PositiveInt = 2
    """Most microbatches an encoder rank holds activations for under ``encoders_ahead``."""
    clip_grad_norm: float | None = Field(1.0, gt=0)
    """Max global grad norm over all modules; null disables clipping."""
    seed: int = 0
    """Seeds data order and anything random in the run."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA when the actors see a GPU, else CPU."""
    precision: Literal["auto", "fp32", "bf16", "bf16-pure"] = "auto"
    """The run's precision recipe, one for every module (each strategy lists the recipes it
    honours; validation refuses the others). ``fp32``: weights, gradients and AdamW state in
    float32 (16 B/param). ``bf16``: bf16 weights for compute (bf16 activations, no autocast)
    with float32 master weights that AdamW steps, gradients accumulated, reduced and clipped in
    float32 (18 B/param). ``bf16-pure``: weights, gradients and AdamW moments all bf16, no
    master (8 B/param; updates under a weight's bf16 spacing are lost). ``auto``: ``fp32`` on
    CPU, ``bf16`` on CUDA. Replaces ``train.dtype``."""
    modules: dict[str, ModuleTrainConfig] = Field(default_factory=dict)
    """Per-module overrides, keyed by ``vision`` / ``audio`` / ``llm``."""

    @field_validator("modules")
    @classmethod
    def _known_modules(cls, v: dict[str, ModuleTrainConfig]) -> dict[str, ModuleTrainConfig]:
        for k in v:
            if k not in MODULES:
                from disagg.config.errors import did_you_mean

                hint = did_you_mean(k, MODULES)
                raise ValueError(f"unknown module {k!r}; allowed: {', '.join(MODULES)}{hint}")
        return v


class CheckpointConfig(Strict):
    every: int = Field(0, ge=0)
    """Save every N steps (0: only at the end)."""
    resume_from: str | None = None
    """A ``checkpoints/step-N`` dir to resume from (``disagg train --resume auto`` picks the
    run dir's newest complete one)."""
    format: Literal["full", "sharded"] = "sharded"
    """``sharded`` (default): every rank writes only its own pieces through
    ``torch.distributed.checkpoint`` (``<module>/dcp/``, about 1/world of the module's state
    each; a LoRA module: of its trained tensors only); a resume in any layout reads only what
    its ranks need. ``zero`` states no layout yet and writes the full form there. ``full``:
    each module's merged parameters and optimizer state in one file each
    (``<module>/full.safetensors``, ``optim.safetensors``), gathered on one rank. Resuming
    and ``disagg export`` take either form."""
    keep_last: int | None = Field(None, ge=1)
    """Keep only the newest K complete checkpoints (``null``: keep all)."""
    keep_best: Literal["eval_loss"] | None = None
    """``eval_loss``: also save a checkpoint at every evaluation that lowers the eval loss, and
    never let ``keep_last`` remove the best one; ``checkpoints/best.json`` names it. Needs
    ``data.eval``."""


class FaultToleranceConfig(Strict):
    max_restarts: int = Field(0, ge=0)
    """When a rank's process or node dies, tear the groups down, recreate them and resume from
    the newest complete checkpoint (from the start if none) up to N times; then stop with an
    error naming the module and rank."""


class LoggingConfig(Strict):
    trackers: list[str] = Field(default_factory=list)
    """Experiment trackers besides ``metrics.jsonl`` (always written): ``tensorboard``,
    ``mlflow``, ``wandb`` (``pip install 'disagg-core[trackers]'``) or a plugin's (see
    ``disagg plugins``)."""
    project: str = "disagg"
    """The MLflow experiment / W&B project runs are grouped under."""
    run_name: str | None = None
    """The run's name in the trackers; default the run dir's name."""
    options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per tracker options, keyed by tracker name: ``tensorboard: {log_dir}`` (default
    ``<run dir>/tensorboard``), ``mlflow: {tracking_uri, experiment}`` (default store
    ``sqlite:///<run dir>/mlflow.db``), ``wandb: {mode, entity}`` (default mode ``offline``)."""


class RayConfig(Strict):
    address: str | None = None
    """``null`` starts an embedded local Ray; ``auto`` joins a running cluster."""
    num_cpus: int | None = None
    """Logical CPUs of the embedded Ray; default max(8, cores, the CPUs the ranks reserve + 2),
    more than cores so that every rank's actor fits and Ray Data keeps CPUs for its preprocessing."""


class Config(Strict):
    model: ModelConfig
    """Which modules the model has, and where each is loaded from."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """How each module is parallelized, placed and connected."""
    data: DataConfig | None = None
    """Training data."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Optimization."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    """Recovery from dead actors."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Experiment trackers."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """The Ray cluster to run on."""
    output_dir: str = "runs/default"
    """Run dir: resolved config, metrics.jsonl, checkpoints/."""

    @field_validator("parallel", mode="before")
    @classmethod
    def _auto(cls, v: Any) -> Any:
        # ``parallel: auto`` is the short form of ``parallel: {auto: {}}``
        if v == "auto":
            return {"auto": {}}
        if isinstance(v, str):
            raise ValueError(
                f"{v!r} is not a parallel section; allowed: a mapping of module groups, or 'auto'"
            )
        if isinstance(v, dict) and v.get("auto") is True:
            return {**v, "auto": {}}
        return v

    def modules(self) -> list[str]:
        """Configured modules, encoders first, the LLM last."""
        return [m for m in MODULES if getattr(self.model, m) is not None]
