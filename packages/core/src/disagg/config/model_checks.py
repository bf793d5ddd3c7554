"""One module (``model.<m>`` with its ``parallel.<m>``): its plugins looked up, its strategy's
options validated, its family built from the path, and the checks the strategy and the family
state about each other; the placeholder token each encoder needs in the LLM's prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from disagg.config.errors import allowed, did_you_mean
from disagg.config.plugin_lookup import lookup
from disagg.config.problems import Problems
from disagg.config.resolved import ResolvedConfig, ResolvedModule, role_of
from disagg.config.schema import Config, GroupConfig
from disagg.config.translate import problems_from_errors
from disagg.interfaces import EncoderFamily, LanguageFamily, StrategyOptions
from disagg.kit import Strategy
from disagg.kit.hf import transformers_problems
from disagg.kit.recompute import tiled_mlp
from disagg.plugins import Registry, provider_of


def local_model_paths(cfg: Config, out: Problems) -> Config:
    """Hub model ids become local snapshot dirs, once, before any family reads them
    (:mod:`disagg.config.model_path`); the resolved config carries the dirs."""
    from disagg.config.model_path import resolve_model_paths

    cfg, problems = resolve_model_paths(cfg)
    for m, message in problems.items():
        out.add(("model", m, "path"), message)
    return cfg


def quiet_llm_family(cfg: Config, reg: Registry) -> LanguageFamily | None:
    """The LLM's family instance for the encoders' ``use_llm``, or None when it
    cannot be made (its own check reports why, in order)."""
    spec = cfg.model.llm
    cls = reg.families.get(("llm", spec.family))
    if cls is None or not Path(spec.path).exists():
        return None
    try:
        return cls(spec.path, spec.options)
    except Exception:
        return None


def resolve_module(
    cfg: Config, reg: Registry, m: str, llm_family: LanguageFamily | None, out: Problems
) -> ResolvedModule | None:
    """Module ``m`` with its plugins, or None when any of its problems was added to ``out``."""
    spec = getattr(cfg.model, m)
    group: GroupConfig = getattr(cfg.parallel, m)
    role = role_of(m)
    strategy_cls = lookup(
        out,
        ("parallel", m, "strategy"),
        "strategy",
        group.strategy,
        reg.strategies,
        provider_of("strategy", group.strategy),
    )
    family_cls = lookup(
        out,
        ("model", m, "family"),
        f"{role} family",
        spec.family,
        {n: cls for (r, n), cls in reg.families.items() if r == role},
        provider_of("family", spec.family, role),
        others={n for (r, n) in reg.families if r != role},
    )
    if not Path(spec.path).exists():  # reported by local_model_paths (not a dir, not a resolvable id)
        family_cls = None  # families read their config from the path
    if family_cls is not None and (too_old := transformers_problems(family_cls, spec.family)):
        for msg in too_old:
            out.add(("model", m, "family"), msg)
        family_cls = None  # its checks would drive the HF classes it cannot run with
    size = group.degree * group.context_parallel * group.replicas
    if group.ranks is not None and group.ranks != size:
        # context_parallel named only where it is set: most configs never use it
        terms = [
            ("degree", group.degree),
            ("context_parallel", group.context_parallel),
            ("replicas", group.replicas),
        ]
        terms = [t for t in terms if t[0] != "context_parallel" or t[1] > 1]
        out.add(
            ("parallel", m, "ranks"),
            f"{group.ranks} does not equal {' × '.join(k for k, _ in terms)} = "
            f"{' × '.join(str(v) for _, v in terms)} = {size}; set ranks to {size} or drop it",
        )
    if group.context_parallel > 1:
        _context_parallel(m, group, strategy_cls, family_cls, out)
    options = _options(m, group, strategy_cls, out) if strategy_cls else None
    for msg in context_parallel_option_problems(group.context_parallel, options):
        out.add(("parallel", m, "context_parallel"), msg)
    if options is not None and strategy_cls is not None:
        _recompute(m, group, strategy_cls, options, out)
        _mlp_tiles(m, group, strategy_cls, options, out)
        # by value, not by presence: a resolved config (run dir, parallel: auto) holds every default
        if m != "llm" and group.loss_chunk_tokens != GroupConfig().loss_chunk_tokens:
            out.add(
                ("parallel", m, "loss_chunk_tokens"),
                f"only the language model computes the loss; set parallel.llm.loss_chunk_tokens "
                f"and remove it from parallel.{m}",
            )
    if strategy_cls is None or family_cls is None or options is None:
        return None
    try:
        family = family_cls(spec.path, spec.options)
        if isinstance(family, EncoderFamily) and llm_family is not None:
            family.use_llm(llm_family)
    except Exception as exc:
        out.add(
            ("model", m), f"family {spec.family!r} cannot read {spec.path!r}: {type(exc).__name__}: {exc}"
        )
        return None
    before = len(out)
    if tiled_mlp.enabled(getattr(options, "mlp_tiles", 1)) and getattr(
        strategy_cls, "mlp_tiles_support", False
    ):
        for msg in tiled_mlp.family_problems(family, spec.family, f"parallel.{m}"):
            out.add(("parallel", m, "mlp_tiles"), msg)
    for who, call in (
        (
            f"strategy {group.strategy!r}",
            lambda: strategy_cls.check(family, group.degree, group.replicas, options),
        ),
        (f"family {spec.family!r}", lambda: family.check(group.strategy, group.degree, group.replicas)),
    ):
        try:
            for msg in call():
                out.add(("parallel", m), msg)
        except Exception as exc:
            out.add(("parallel", m), f"{who} check failed: {type(exc).__name__}: {exc}")
    per_mb = cfg.data.batch_size // cfg.train.microbatches if cfg.data else None
    if getattr(strategy_cls, "lockstep", False) and per_mb is not None and per_mb < group.replicas:
        out.add(
            ("parallel", m, "replicas"),
            f"{group.replicas} replicas of strategy {group.strategy!r} need a sample each in every "
            f"microbatch (its ranks run in lockstep), but a microbatch has "
            f"data.batch_size // train.microbatches = {per_mb}; "
            f"use replicas <= {per_mb} or a larger batch",
        )
    if len(out) > before:
        return None
    return ResolvedModule(
        m, role, strategy_cls, options, family, group.degree, group.replicas, group.context_parallel
    )


def context_parallel_option_problems(context_parallel: int, options: StrategyOptions | None) -> list[str]:
    """What ``context_parallel`` cannot be combined with among a strategy's options (the planner
    asks too, before it offers a CP layout)."""
    if options is not None and context_parallel > 1 and getattr(options, "sequence_parallel", False):
        # composes on paper (SP splits each rank's own tokens), but no test covers it yet
        return [
            f"{context_parallel} with sequence_parallel: true is not supported yet; "
            "use sequence_parallel: false with context_parallel, or context_parallel: 1"
        ]
    return []


def _context_parallel(
    m: str, group: GroupConfig, strategy_cls: type[Strategy] | None, family_cls: type | None, out: Problems
) -> None:
    """``parallel.<m>.context_parallel`` > 1: only a decoder splits its sequence, and only
    with a strategy and a family that say they can (the heads need no extra divisibility:
    keys and values are all-gathered whole, :mod:`disagg.kit.context_parallel`)."""
    key, n = ("parallel", m, "context_parallel"), group.context_parallel
    if m != "llm":
        out.add(
            key,
            f"{n}: only the language model (parallel.llm) splits its sequence over context-parallel "
            f"ranks; use 1 here (allowed: 1), or sequence parallelism through the strategy's degree",
        )
        return
    if strategy_cls is not None and not getattr(strategy_cls, "context_parallel_support", False):
        out.add(
            key,
            f"{n}: strategy {group.strategy!r} does not support context parallelism; "
            f"use 1, or a strategy that does (ddp, megatron_tp)",
        )
    if family_cls is not None and not getattr(family_cls, "context_parallel_support", False):
        out.add(
            key,
            f"{n}: family {getattr(family_cls, 'name', family_cls.__name__)!r} cannot split its "
            f"sequence over context-parallel ranks; use 1 (families that can: qwen2, llama, qwen2_5_vl)",
        )


def _options(
    m: str, group: GroupConfig, strategy_cls: type[Strategy], out: Problems
) -> StrategyOptions | None:
    """``parallel.<m>``'s keys beyond the group's own, as the strategy's options model reads them."""
    model = strategy_cls.options_model
    try:
        return model.model_validate(group.strategy_options())
    except ValidationError as exc:
        own = list(GroupConfig.model_fields)
        for err in exc.errors():
            if err["type"] == "extra_forbidden":
                key = str(err["loc"][-1])
                opts = [o for o in model.model_fields if o not in own]
                hint = did_you_mean(key, own + opts)
                out.add(
                    ("parallel", m, key),
                    f"unknown key {key!r} for strategy {group.strategy!r}; {allowed(own + opts)}{hint}",
                )
        rest = [e for e in exc.errors() if e["type"] != "extra_forbidden"]
        out.extend(problems_from_errors(rest, model, out.source, prefix=("parallel", m)))
        return None


def _recompute(m: str, group: GroupConfig, strategy_cls: type[Strategy], options: Any, out: Problems) -> None:
    mode = getattr(options, "recompute", "none")
    modes = tuple(getattr(strategy_cls, "recompute_modes", ("none",)))
    if mode not in modes:
        out.add(
            ("parallel", m, "recompute"),
            f"strategy {group.strategy!r} cannot recompute {mode!r} for module {m!r}; {allowed(list(modes))}",
        )


#: why a strategy may not tile: ``zero`` (DeepSpeed) gathers ZeRO-3 parameters in module hooks and
#: marks gradients ready in its own backward hooks; a tile replayed inside autograd's backward is
#: not proven to get its parameters gathered and its gradients reduced once (DeepSpeed's own
#: ``TiledMLP`` replaces autograd's backward to mark ``ds_grad_is_ready`` itself), so it is refused
#: rather than risked
TILES_STRATEGIES = ("ddp", "ulysses", "megatron_tp")


def _mlp_tiles(m: str, group: GroupConfig, strategy_cls: type[Strategy], options: Any, out: Problems) -> None:
    tiles = getattr(options, "mlp_tiles", 1)
    if tiled_mlp.enabled(tiles) and not getattr(strategy_cls, "mlp_tiles_support", False):
        why = (
            " (DeepSpeed's ZeRO-3 gathers parameters and marks gradients ready in its own hooks, "
            "which a tile replayed inside autograd's backward is not proven to keep exact)"
            if group.strategy == "zero"
            else ""
        )
        out.add(
            ("parallel", m, "mlp_tiles"),
            f"{tiles!r}: strategy {group.strategy!r} does not run sequence-tiled MLPs{why}; "
            f"allowed: 1, or strategy {', '.join(TILES_STRATEGIES)}",
        )


def check_placeholders(resolved: ResolvedConfig, out: Problems) -> None:
    """Every encoder needs a placeholder token in the LLM's prompts; without
    one, preprocessing would fail late, inside a data worker."""
    llm = resolved.modules.get("llm")
    if llm is None:
        return
    for m in resolved.modules:
        if m == "llm":
            continue
        try:
            llm.family.placeholder_token_id(m)  # type: ignore[attr-defined]
        except Exception as exc:
            out.add(("model", "llm", "family"), f"{exc} (needed by model.{m})")
