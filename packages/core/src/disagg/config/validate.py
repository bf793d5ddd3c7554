"""Checks that need the plugins but no actor: run before anything starts.

Every problem is collected (not just the first) and raised together in one
:class:`ConfigError`, each located by the :class:`SourceMap`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from disagg.config.errors import ConfigError, Problem, allowed, did_you_mean
from disagg.config.fingerprint import fingerprint_differences, run_fingerprint
from disagg.config.schema import MODULES, Config, GroupConfig
from disagg.config.source import SourceMap, dotted
from disagg.config.translate import problems_from_errors
from disagg.interfaces import EncoderFamily, Family, LanguageFamily, Strategy, StrategyOptions
from disagg.plugins import Registry, provider_of


@dataclass
class ResolvedModule:
    """One configured module with its plugins looked up."""

    name: str
    role: str
    strategy: type[Strategy]
    options: StrategyOptions
    family: Family
    degree: int
    replicas: int


@dataclass
class ResolvedConfig:
    """A config that passed every actor-free check, plugins resolved."""

    config: Config
    modules: dict[str, ResolvedModule] = field(default_factory=dict)
    transport: str = "auto"


def reserved_cpus(resolved: ResolvedConfig) -> float:
    """Logical CPUs the training ranks reserve: degree x replicas x
    ``resources.num_cpus`` per module."""
    return sum(
        m.degree * m.replicas * getattr(resolved.config.parallel, name).resources.num_cpus
        for name, m in resolved.modules.items()
    )


def role_of(module: str) -> str:
    return "llm" if module == "llm" else "encoder"


def validate(cfg: Config, registry: Registry, *, source: SourceMap | None = None) -> ResolvedConfig:
    """Check ``cfg`` against the installed plugins and the file system.

    Returns the resolved config, or raises :class:`ConfigError` with every
    problem found. Relative paths are taken from the current directory.
    """
    checker = _Checker(cfg, registry, source)
    resolved = checker.run()
    if checker.problems:
        raise ConfigError(checker.problems)
    return resolved


class _Checker:
    def __init__(self, cfg: Config, registry: Registry, source: SourceMap | None) -> None:
        self.cfg, self.reg, self.source = cfg, registry, source
        self.problems: list[Problem] = []

    def add(self, path: Sequence[str | int], message: str) -> None:
        where = self.source.where(path) if self.source else None
        self.problems.append(Problem(dotted(path), message, where))

    def run(self) -> ResolvedConfig:
        self.model_paths()
        resolved = ResolvedConfig(config=self.cfg, transport=self.cfg.parallel.transport)
        self.llm_family = self._quiet_llm_family()
        for m in self.cfg.modules():
            module = self.module(m)
            if module is not None:
                resolved.modules[m] = module
        self.unused_groups()
        self.placeholders(resolved)
        self.ray(resolved)
        self.transport()
        self.devices()
        self.precision(resolved)
        self.train(resolved)
        self.data(resolved)
        self.evaluation()
        self.trackers()
        self.resume()
        if self.cfg.train.epochs is not None and not self.problems:
            try:
                resolved.config = with_epoch_steps(self.cfg)
            except Exception as exc:  # e.g. a row of unknown format: named with its file and line
                self.add(("train", "epochs"), f"cannot count the samples of data.train: {exc}")
        return resolved

    def model_paths(self) -> None:
        """Hub model ids become local snapshot dirs, once, before any family reads them
        (:mod:`disagg.config.model_path`); the resolved config carries the dirs."""
        from disagg.config.model_path import resolve_model_paths

        self.cfg, problems = resolve_model_paths(self.cfg)
        for m, message in problems.items():
            self.add(("model", m, "path"), message)

    def placeholders(self, resolved: ResolvedConfig) -> None:
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
                self.add(("model", "llm", "family"), f"{exc} (needed by model.{m})")

    def ray(self, resolved: ResolvedConfig) -> None:
        """An embedded Ray too small for the ranks would wait forever for actors."""
        n = self.cfg.ray.num_cpus
        if n is None or self.cfg.ray.address:
            return
        need = reserved_cpus(resolved)
        if n < need:
            self.add(
                ("ray", "num_cpus"),
                f"{n} logical CPUs cannot hold the ranks, which reserve {need:g} "
                "(degree x replicas x resources.num_cpus per module); raise it, or remove it "
                "for the default max(8, cores, reserved + 2)",
            )

    def resume(self) -> None:
        path = self.cfg.checkpoint.resume_from
        if not path:
            return
        key = ("checkpoint", "resume_from")
        meta = Path(path) / "meta.json"
        if not meta.is_file():
            what = "does not exist" if not Path(path).exists() else "has no meta.json (not a checkpoint dir)"
            self.add(key, f"{path!r} {what}")
            return
        if not (Path(path) / "manifest.json").is_file():
            self.add(
                key,
                f"{path!r} has no manifest.json: its save did not finish (or it predates checksummed "
                "checkpoints); pick a complete checkpoint (disagg train --resume auto finds the newest)",
            )
            return
        saved = json.loads(meta.read_text()).get("fingerprint")
        if saved is None:
            return  # written before fingerprints existed: nothing to compare
        for difference in fingerprint_differences(saved, run_fingerprint(self.cfg)):
            self.add(key, f"cannot resume from {path!r}: {difference}")

    # -- one module ------------------------------------------------------------------------------
    def module(self, m: str) -> ResolvedModule | None:
        spec = getattr(self.cfg.model, m)
        group: GroupConfig = getattr(self.cfg.parallel, m)
        role = role_of(m)
        strategy_cls = self.lookup(
            ("parallel", m, "strategy"),
            "strategy",
            group.strategy,
            self.reg.strategies,
            provider_of("strategy", group.strategy),
        )
        family_cls = self.lookup(
            ("model", m, "family"),
            f"{role} family",
            spec.family,
            {n: cls for (r, n), cls in self.reg.families.items() if r == role},
            provider_of("family", spec.family, role),
            others={n for (r, n) in self.reg.families if r != role},
        )
        if not Path(spec.path).exists():  # reported by model_paths (not a dir, not a resolvable id)
            family_cls = None  # families read their config from the path
        if group.ranks is not None and group.ranks != group.degree * group.replicas:
            self.add(
                ("parallel", m, "ranks"),
                f"{group.ranks} does not equal degree × replicas = {group.degree} × {group.replicas} "
                f"= {group.degree * group.replicas}; set ranks to {group.degree * group.replicas} or drop it",
            )
        options = self.options(m, group, strategy_cls) if strategy_cls else None
        if options is not None and strategy_cls is not None:
            self.recompute(m, group, strategy_cls, options)
            # by value, not by presence: a resolved config (run dir, parallel: auto) holds every default
            if m != "llm" and group.loss_chunk_tokens != GroupConfig().loss_chunk_tokens:
                self.add(
                    ("parallel", m, "loss_chunk_tokens"),
                    f"only the language model computes the loss; set parallel.llm.loss_chunk_tokens "
                    f"and remove it from parallel.{m}",
                )
        if strategy_cls is None or family_cls is None or options is None:
            return None
        try:
            family = family_cls(spec.path, spec.options)
            if isinstance(family, EncoderFamily) and self.llm_family is not None:
                family.use_llm(self.llm_family)
        except Exception as exc:
            self.add(
                ("model", m), f"family {spec.family!r} cannot read {spec.path!r}: {type(exc).__name__}: {exc}"
            )
            return None
        before = len(self.problems)
        for who, call in (
            (
                f"strategy {group.strategy!r}",
                lambda: strategy_cls.check(family, group.degree, group.replicas, options),
            ),
            (f"family {spec.family!r}", lambda: family.check(group.strategy, group.degree, group.replicas)),
        ):
            try:
                for msg in call():
                    self.add(("parallel", m), msg)
            except Exception as exc:
                self.add(("parallel", m), f"{who} check failed: {type(exc).__name__}: {exc}")
        per_mb = self.cfg.data.batch_size // self.cfg.train.microbatches if self.cfg.data else None
        if getattr(strategy_cls, "lockstep", False) and per_mb is not None and per_mb < group.replicas:
            self.add(
                ("parallel", m, "replicas"),
                f"{group.replicas} replicas of strategy {group.strategy!r} need a sample each in every "
                f"microbatch (its ranks run in lockstep), but a microbatch has "
                f"data.batch_size // train.microbatches = {per_mb}; "
                f"use replicas <= {per_mb} or a larger batch",
            )
        if len(self.problems) > before:
            return None
        return ResolvedModule(m, role, strategy_cls, options, family, group.degree, group.replicas)

    def _quiet_llm_family(self) -> LanguageFamily | None:
        """The LLM's family instance for the encoders' ``use_llm``, or None when it
        cannot be made (its own check reports why, in order)."""
        spec = self.cfg.model.llm
        cls = self.reg.families.get(("llm", spec.family))
        if cls is None or not Path(spec.path).exists():
            return None
        try:
            return cls(spec.path, spec.options)
        except Exception:
            return None

    def lookup(
        self,
        path: tuple,
        what: str,
        name: str,
        table: dict[str, Any],
        provider: str | None,
        others: set[str] | None = None,
    ) -> Any:
        """``others``: names registered for another role (a family named under the wrong module)."""
        if name in table:
            return table[name]
        names = sorted(table)
        if others and name in others:
            self.add(
                path,
                f"{name!r} is not an {what} (it is registered for another role); installed "
                f"{what.replace('family', 'families')}: {', '.join(names) or 'none'}",
            )
        elif provider is not None:
            self.add(
                path,
                f"{what} {name!r} is provided by {provider}, which is not installed or not loaded; "
                f"run: pip install {provider}{self.limited_hint()}",
            )
        elif others is not None:  # a family: name what is installed, never another model version
            self.add(
                path,
                f"unknown {what} {name!r}; installed {what.replace('family', 'families')}: "
                f"{', '.join(names) or 'none'}"
                f"{_same_version_hint(name, names)}",
            )
        else:
            self.add(path, f"unknown {what} {name!r}; {allowed(names)}{did_you_mean(name, names)}")
        return None

    def limited_hint(self) -> str:
        import os

        limit = os.environ.get("DISAGG_PLUGINS")
        return f" (DISAGG_PLUGINS={limit!r} limits which installed plugins load)" if limit is not None else ""

    def options(self, m: str, group: GroupConfig, strategy_cls: type[Strategy]) -> StrategyOptions | None:
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
                    self.add(
                        ("parallel", m, key),
                        f"unknown key {key!r} for strategy {group.strategy!r}; {allowed(own + opts)}{hint}",
                    )
            rest = [e for e in exc.errors() if e["type"] != "extra_forbidden"]
            self.problems += problems_from_errors(rest, model, self.source, prefix=("parallel", m))
            return None

    def recompute(self, m: str, group: GroupConfig, strategy_cls: type[Strategy], options: Any) -> None:
        mode = getattr(options, "recompute", "none")
        modes = tuple(getattr(strategy_cls, "recompute_modes", ("none",)))
        if mode not in modes:
            self.add(
                ("parallel", m, "recompute"),
                f"strategy {group.strategy!r} cannot recompute {mode!r} for module {m!r}; "
                f"{allowed(list(modes))}",
            )

    # -- whole config ----------------------------------------------------------------------------
    def unused_groups(self) -> None:
        default = GroupConfig().model_dump()
        configured = self.cfg.modules()
        for m in MODULES:
            if m not in configured and getattr(self.cfg.parallel, m).model_dump() != default:
                self.add(
                    ("parallel", m),
                    f"is set but model.{m} is not configured; add model.{m} or remove parallel.{m}",
                )

    def transport(self) -> None:
        name = self.cfg.parallel.transport
        names = ["auto", *self.reg.transport_names()]
        if name not in names:
            self.add(
                ("parallel", "transport"),
                f"unknown transport {name!r}; {allowed(names)}{did_you_mean(name, names)}",
            )
            return
        cls = self.reg.transports.get(name)
        if cls is not None and cls.unavailable_reason:
            usable = ["auto", *(n for n, t in self.reg.transports.items() if not t.unavailable_reason)]
            self.add(
                ("parallel", "transport"),
                f"{name!r} cannot be used: {cls.unavailable_reason}; {allowed(usable)}",
            )

    def devices(self) -> None:
        """GPU shares and the transport's fit to the layout, for the configured
        device (``auto``: what is wrong on any device; the plan checks again
        once the device is known)."""
        from disagg.config.devices import gpu_share_problems, transport_problems

        device = self.cfg.train.device
        for path, message in gpu_share_problems(self.cfg, device) + transport_problems(
            self.cfg, self.reg, device
        ):
            self.add(path, message)

    def precision(self, resolved: ResolvedConfig) -> None:
        """``train.precision`` against every module's strategy (``auto`` once the device is
        known; on ``train.device: auto`` the plan checks it again, before any actor starts)."""
        device = self.cfg.train.device
        if self.cfg.train.precision == "auto" and device == "auto":
            return
        for path, message in precision_problems(resolved, device):
            self.add(path, message)

    def train(self, resolved: ResolvedConfig) -> None:
        t = self.cfg.train
        configured = self.cfg.modules()
        for m, mt in t.modules.items():
            if m not in configured:
                self.add(
                    ("train", "modules", m), f"module {m!r} is not configured in model; {allowed(configured)}"
                )
            elif m in resolved.modules:
                self.parts(m, mt, resolved.modules[m].family)
                self.lora(m, mt, resolved.modules[m])
        if t.schedule not in self.reg.schedules:
            names = sorted(self.reg.schedules)
            self.add(
                ("train", "schedule"),
                f"unknown schedule {t.schedule!r}; {allowed(names)}{did_you_mean(t.schedule, names)}",
            )
        kinds = _scheduler_kinds()
        for path, kind in [(("train", "scheduler"), t.scheduler)] + [
            (("train", "modules", m, "scheduler"), mt.scheduler)
            for m, mt in t.modules.items()
            if mt.scheduler
        ]:
            if kinds and kind not in kinds:
                self.add(path, f"unknown scheduler {kind!r}; {allowed(kinds)}{did_you_mean(kind, kinds)}")

    def lora(self, m: str, mt: Any, module: ResolvedModule) -> None:
        """``train.modules.<m>.lora`` (:mod:`disagg.config.lora_checks`)."""
        from disagg.config.lora_checks import lora_problems

        strategy = getattr(self.cfg.parallel, m).strategy
        for path, message in lora_problems(m, mt, module.family, module.strategy, strategy):
            self.add(path, message)

    def parts(self, m: str, mt: Any, family: Family) -> None:
        """Part names in ``freeze: [..]`` and ``param_groups`` are the family's."""
        key = ("train", "modules", m)
        try:
            parts = family.parts()
        except Exception as exc:
            self.add(key, f"family {family.name!r} cannot list its parts: {type(exc).__name__}: {exc}")
            return
        names = sorted(parts)
        if names:
            known = f"family {family.name!r} names the parts: {', '.join(names)}"
        else:
            known = f"family {family.name!r} names no parts (use freeze: true or false)"
        listed = mt.freeze if isinstance(mt.freeze, list) else []
        frozen = {pattern for n in listed if n in parts for pattern in parts[n]}
        for i, name in enumerate(listed):
            if name not in parts:
                self.add((*key, "freeze", i), f"unknown part {name!r}; {known}{did_you_mean(name, names)}")
        for name in mt.param_groups:
            if name not in parts:
                self.add(
                    (*key, "param_groups", name), f"unknown part {name!r}; {known}{did_you_mean(name, names)}"
                )
            elif mt.freeze is True or name in listed or set(parts[name]) <= frozen:
                self.add(
                    (*key, "param_groups", name),
                    f"part {name!r} is frozen (train.modules.{m}.freeze), so it has no optimizer settings; "
                    "remove it from param_groups or from freeze",
                )

    def data(self, resolved: ResolvedConfig) -> None:
        d = self.cfg.data
        if d is None:
            return
        from disagg.data.checks import data_problems

        for path, message in data_problems(self.cfg, {m: r.family for m, r in resolved.modules.items()}):
            self.add(path, message)
        entries = (
            [(("data", "train"), d.train, None)]
            if isinstance(d.train, str)
            else [(("data", "train", i, "path"), e.path, e.media_root) for i, e in enumerate(d.train)]
        )
        if d.eval:
            entries.append((("data", "eval"), d.eval, None))
        for path, file, media_root in entries:
            # a Hugging Face dataset (data.format: hf) is a dir
            if not (Path(file).is_file() or Path(file).is_dir()):
                self.add(path, f"data file {file!r} does not exist (relative paths are from {Path.cwd()})")
            if media_root and not Path(media_root).is_dir():
                self.add((*path[:-1], "media_root"), f"{media_root!r} is not a directory")
        if not Path(d.media_root).is_dir():
            self.add(("data", "media_root"), f"{d.media_root!r} is not a directory")
        if d.batch_size < self.cfg.train.microbatches:
            self.add(
                ("data", "batch_size"),
                f"{d.batch_size} is smaller than train.microbatches = {self.cfg.train.microbatches}; "
                f"every microbatch needs a sample: use batch_size >= {self.cfg.train.microbatches}",
            )

    def evaluation(self) -> None:
        """``train.epochs`` (instead of steps), ``train.eval_every`` and
        ``checkpoint.keep_best`` against what the data section provides. A
        config without ``data`` runs only with a data source given in code:
        the run checks it then."""
        t, d = self.cfg.train, self.cfg.data
        if t.epochs is not None:
            if "steps" in t.model_fields_set:
                self.add(
                    ("train", "epochs"),
                    f"{t.epochs:g} is set together with train.steps = {t.steps}; set exactly one of them",
                )
            if d is None:
                self.add(("train", "epochs"), "needs data.train to count the samples of an epoch")
        if d is None:
            return
        if t.eval_every and not d.eval:
            self.add(("train", "eval_every"), f"{t.eval_every} needs data.eval (a held-out dataset file)")
        if self.cfg.checkpoint.keep_best and not d.eval:
            self.add(
                ("checkpoint", "keep_best"),
                f"{self.cfg.checkpoint.keep_best!r} needs data.eval (a held-out dataset file)",
            )

    def trackers(self) -> None:
        log = self.cfg.logging
        names = sorted(n for n in self.reg.trackers if n != "jsonl")
        for i, name in enumerate(log.trackers):
            cls = self.reg.trackers.get(name)
            if cls is None:
                self.add(
                    ("logging", "trackers", i),
                    f"unknown tracker {name!r}; {allowed(names)}{did_you_mean(name, names)}",
                )
                continue
            missing = cls.missing()
            if missing:
                self.add(
                    ("logging", "trackers", i),
                    f"tracker {name!r} needs {', '.join(missing)}, which is not installed; run: "
                    f"{cls.install} (or pip install 'disagg-core[trackers]' for every first-party tracker)",
                )
        for name, opts in log.options.items():
            cls = self.reg.trackers.get(name)
            if name not in log.trackers or cls is None:
                self.add(
                    ("logging", "options", name),
                    f"options for tracker {name!r}, which logging.trackers does not name; "
                    f"{allowed(list(log.trackers))}",
                )
                continue
            try:
                cls.options_model.model_validate(opts)
            except ValidationError as exc:
                self.problems += problems_from_errors(
                    exc.errors(), cls.options_model, self.source, prefix=("logging", "options", name)
                )


def precision_problems(resolved: ResolvedConfig, device: str) -> list[tuple[tuple[str, ...], str]]:
    """``train.precision`` (``auto`` resolved for ``device``) for each module whose strategy
    does not list it in :attr:`Strategy.precisions`: the key, the module, the strategy, and the
    recipes it honours."""
    from disagg.interfaces.precision import resolve_precision

    name = resolved.config.train.precision
    recipe = resolve_precision(name, device).name
    said = repr(name) if name != "auto" else f"auto (resolved to {recipe!r} on {device})"
    out = []
    for m, module in resolved.modules.items():
        if recipe == "bf16" and getattr(module.options, "overlap_grad_reduce", False):
            out.append(
                (
                    ("parallel", m, "overlap_grad_reduce"),
                    f"true cannot be combined with train.precision: {said} (its buckets would sum "
                    "the bf16 gradients, not the float32 ones the recipe reduces); set "
                    "overlap_grad_reduce: false or train.precision: fp32 / bf16-pure",
                )
            )
        allowed_here = tuple(module.strategy.precisions)
        if recipe not in allowed_here:
            strategy = getattr(resolved.config.parallel, m).strategy
            out.append(
                (
                    ("train", "precision"),
                    f"{said} is not honoured by strategy {strategy!r} of module {m!r} "
                    f"(parallel.{m}.strategy); it honours: {', '.join(allowed_here)}; set "
                    f"train.precision to one of those or pick another strategy for {m}",
                )
            )
    return out


def with_epoch_steps(cfg: Config) -> Config:
    """``cfg`` with ``train.steps`` derived from ``train.epochs``:
    ceil(epochs x samples in data.train / data.batch_size); ``epochs`` is
    then cleared, so the resolved config runs as written."""
    from disagg.data.index import index_dataset
    from disagg.data.source import dataset_entries

    assert cfg.data is not None and cfg.train.epochs is not None
    data = cfg.data
    samples = sum(
        index_dataset(
            e.path, e.media_root if e.media_root is not None else data.media_root, e.format or data.format
        ).size
        for e in dataset_entries(cfg, "train")
    )
    steps = max(1, math.ceil(cfg.train.epochs * samples / cfg.data.batch_size))
    train = cfg.train.model_copy(update={"steps": steps, "epochs": None})
    return cfg.model_copy(update={"train": train})


def _same_version_hint(name: str, names: list[str]) -> str:
    """A did-you-mean that never offers another version of a model (``qwen3_vl`` is
    not a typo of ``qwen2_5_vl``, and that family cannot load it)."""
    import difflib
    import re

    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if close and re.findall(r"\d+", close[0]) == re.findall(r"\d+", name):
        return f" (did you mean {close[0]!r}?)"
    return ""


def _scheduler_kinds() -> list[str]:
    try:
        from transformers import SchedulerType
    except ImportError:  # validation should not depend on it; the run will complain
        return []
    return [s.value for s in SchedulerType]
