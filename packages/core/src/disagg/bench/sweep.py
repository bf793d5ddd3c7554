"""The sweep: every layout at every vision length, measured and predicted, and
(with a budget) the longest vision sequence each layout fits, by bisection
with real steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg.bench.data import grid_for, private_model_dir, snap_length, write_sweep_data
from disagg.bench.fit_search import longest_fitting
from disagg.bench.runner import Progress, layout_config, memory_per_rank, run_layout, summarize
from disagg.bench.versus import machine_load, point_versus
from disagg.config.schema import Config
from disagg.cost import EncoderShape, predict
from disagg.plugins import Registry

#: windows the analytic guess may reach: far past any device (a guess only places probes)
PREDICTED_CAP = 2**22


@dataclass
class Bench:
    base: Config
    layouts: dict[str, dict[str, Any]]
    vision_tokens: list[int]
    samples: int
    steps: int
    #: ``train.precision`` every layout runs, resolved (``auto`` decided once for all of them)
    precision: str
    out_dir: Path
    registry: Registry
    budget: int | None = None
    #: the budget search never probes past this length (default: 4 x the longest swept)
    max_vision_tokens: int | None = None
    progress: Progress | None = None
    #: the time model of the predicted step times (:class:`~disagg.plan.cluster.Cluster`;
    #: default the ``cpu`` preset; ``--calibrate``: this machine measured)
    cluster: Any = None
    points: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.base.model.vision is None:
            raise ValueError("disagg bench sweeps the vision length: the config needs model.vision")
        src = Path(self.base.model.vision.path)
        from disagg.plan.workload import config_shapes

        shapes = config_shapes(self.base)
        vision = shapes.get("vision")
        if not isinstance(vision, EncoderShape) or not vision.window:
            raise ValueError(
                f"model.vision ({src}): the sweep makes images of whole attention windows; "
                f"family {self.base.model.vision.family!r} describes no windowed tower"
            )
        self.shapes = shapes
        self.vision: EncoderShape = vision
        self.window_side = max(vision.window // vision.patch, vision.merge)
        for n in self.vision_tokens:  # refuse an unusable length before any run
            grid_for(n, self.window_side, vision.merge)
        self.placement = self.base.parallel.placement
        self._src = src
        self._model_dir: Path | None = None
        #: layout name -> its sweep run's config and that config validated (:meth:`check`)
        self._validated: dict[str, tuple[Config, Any]] = {}

    # -- one point --------------------------------------------------------------------------------
    def model_dirs(self, max_patches: int) -> dict[str, str]:
        """Both modules read a private copy of the model dir whose processor keeps long images."""
        if self._model_dir is None or max_patches > self._max_patches:
            self._max_patches = max(max_patches, 2 * max(self.vision_tokens))
            self._model_dir = private_model_dir(
                self._src, self.out_dir / "model", self._max_patches, self.vision.patch
            )
        dirs = {"vision": str(self._model_dir)}
        if self.base.model.llm.path == str(self._src) or Path(self.base.model.llm.path) == self._src:
            dirs["llm"] = str(self._model_dir)
        return dirs

    def data(self, n: int) -> Path:
        out = self.out_dir / "data" / f"v{n}"
        if not (out / "train.jsonl").exists():
            write_sweep_data(
                out,
                n,
                self.samples * self.steps,
                self.vision.patch,
                self.window_side,
                self.vision.merge,
                self.base.train.seed,
            )
        return out / "train.jsonl"

    def config(self, name: str, lengths: list[int], steps: int | None = None, tag: str = "") -> Config:
        """The train config of one run of layout ``name`` over ``lengths`` (its data written)."""
        steps = steps or self.steps
        jsonls = [self.data(n) for n in lengths]
        return layout_config(
            self.base,
            self.layouts[name],
            train_jsonl=jsonls[0],
            model_dirs=self.model_dirs(max(lengths)),
            samples=self.samples,
            steps=steps * len(lengths),
            precision=self.precision,
            out_dir=self.out_dir
            / "runs"
            / f"{name}{tag.strip().replace(' ', '-')}-{'-'.join(map(str, lengths))}",
        )

    def check(self) -> None:
        """Validate every layout's sweep run (its plugins, options and config) before the
        first run starts, so that a missing plugin or a bad option of the last layout is
        found in seconds, not after the others ran; raises one :class:`ConfigError`
        listing every layout's problems. The validated configs are the runs' own."""
        from disagg.config.errors import ConfigError, Problem
        from disagg.config.validate import validate

        found: list[Problem] = []
        for name in self.layouts:
            cfg = self.config(name, self.vision_tokens)
            try:
                self._validated[name] = (cfg, validate(cfg, self.registry))
            except ConfigError as exc:
                found += [Problem(p.key, f"layout {name!r}: {p.message}", p.where) for p in exc.problems]
        if found:
            raise ConfigError(found)

    def _resolved(self, name: str, cfg: Config) -> Any:
        """``cfg`` validated: :meth:`check`'s result when it is the same config, else validated now
        (a budget probe's)."""
        from disagg.config.validate import validate

        checked, resolved = self._validated.get(name, (None, None))
        return resolved if checked == cfg else validate(cfg, self.registry)

    def keep(self, points: list[dict[str, Any]]) -> None:
        """Append finished points to ``points.jsonl`` at once: a bench stopped (or failed)
        later keeps every layout that finished."""
        import json

        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / "points.jsonl", "a") as f:
            for p in points:
                f.write(json.dumps(p) + "\n")

    def run(
        self, name: str, lengths: list[int], steps: int | None = None, tag: str = ""
    ) -> list[dict[str, Any]]:
        """One run of layout ``name`` over ``lengths``: a point per length."""
        steps = steps or self.steps
        label = f"{name} @ {', '.join(map(str, lengths))} vision tokens{tag}"
        if self.progress:
            self.progress.start(label)
        jsonls = [self.data(n) for n in lengths]
        cfg = self.config(name, lengths, steps, tag)
        per_length, error = run_layout(self._resolved(name, cfg), self.registry, jsonls, steps)
        points = []
        for n, records in zip(lengths, per_length):
            point: dict[str, Any] = {
                "layout": name,
                "vision_tokens": n,
                "grid": list(grid_for(n, self.window_side, self.vision.merge)),
            }
            if records:
                point["measured"] = summarize(records)
            else:
                point["error"] = error or "no step ran"
            tokens = point.get("measured", {}).get("tokens_per_step")
            point["predicted"] = self.predict(name, n, tokens)
            point["predicted"]["step_time_s"], why = self.predict_step_time(name, n, tokens)
            if why:
                point["predicted"]["step_time_why"] = why
            point["memory_per_rank"] = {"predicted": point["predicted"]["memory_per_rank"]}
            if "measured" in point:
                point["memory_per_rank"]["measured"] = memory_per_rank(
                    point["measured"]["groups"], self.placement
                )
            if self.budget is not None:
                point["fits_budget"] = _fits(point, self.budget)
            if "measured" in point:
                point["predicted_vs_measured"] = point_versus(point)
            point["load_after"] = machine_load()  # timed figures depend on what else ran
            points.append(point)
        if self.progress:
            done = ", ".join(
                f"{p['vision_tokens']}: {p['measured']['tokens_per_s']:.0f} tok/s"
                if "measured" in p
                else f"{p['vision_tokens']}: failed"
                for p in points
            )
            self.progress.finish(f"{label}: {done}" + (f" ({error[:160]})" if error else ""))
        return points

    def predict(self, name: str, n: int, tokens_per_step: int | None) -> dict[str, Any]:
        """The analytic model's figures for this point, per module and per device."""
        parallel = self.layouts[name]
        rows = n // self.vision.unit
        mb = self.samples // int(parallel.get("vision", {}).get("replicas", 1))
        llm_tokens = tokens_per_step // self.samples if tokens_per_step else rows + 32
        out: dict[str, Any] = {"groups": {}}
        for module, shape in self.shapes.items():
            group = parallel.get(module, {})
            # the strategy's own keys (e.g. a ds_config): its estimate reads them as a run would
            opts = {
                k: v for k, v in group.items() if k not in ("strategy", "degree", "replicas", "recompute")
            }
            kw: dict[str, Any] = {}
            if module != "vision":
                kw = {"exchanged_rows": rows, "exchanged_width": self.vision.out_hidden}
            cost = predict(
                shape,
                group.get("strategy", "ddp"),
                int(group.get("degree", 1)),
                int(group.get("replicas", 1)),
                n if module == "vision" else llm_tokens,
                self.precision,
                samples=self.samples,
                microbatches=mb,
                options=opts,
                recompute=group.get("recompute", "none"),
                **kw,
            )
            out["groups"][module] = {
                **cost.to_dict(),
                "recompute": group.get("recompute", "none"),
                "ranks": int(group.get("degree", 1)) * int(group.get("replicas", 1)),
            }
        figures = [g["memory_bytes"] for g in out["groups"].values()]
        out["memory_per_rank"] = sum(figures) if self.placement == "collocated" else max(figures)
        return out

    def time_model(self) -> Any:
        """The cluster the step times are predicted on: :attr:`cluster`, or the ``cpu`` preset."""
        from disagg.plan.cluster import PRESETS

        return self.cluster if self.cluster is not None else PRESETS["cpu"]

    def predict_step_time(self, name: str, n: int, tokens_per_step: int | None) -> tuple[float | None, str]:
        """The planner's step time of layout ``name`` at ``n`` patches per image (the model
        ``disagg plan`` ranks with, :func:`~disagg.plan.own.own_layout`), or None and why not.
        The time model gets as many devices as the layout's groups take: the bench runs
        them whatever the machine's cores (its load is recorded beside the times)."""
        from dataclasses import replace

        from disagg.plan.model import Workload
        from disagg.plan.own import own_layout

        rows = n // self.vision.unit
        text = tokens_per_step // self.samples - rows if tokens_per_step else 32
        cfg = self._validated[name][0] if name in self._validated else self.config(name, [n])
        work = Workload(
            shapes=self.shapes,
            vision_tokens=n,
            text_tokens=text,
            samples=self.samples,
            precision=self.precision,
            max_inflight=cfg.train.max_inflight,
        )
        groups = [g for g in self.layouts[name].values() if isinstance(g, dict)]
        ranks = [int(g.get("degree", 1)) * int(g.get("replicas", 1)) for g in groups]
        need = sum(ranks) if self.placement == "disaggregated" else max(ranks)
        cluster = self.time_model()
        if cluster.devices < need:
            cluster = replace(cluster, devices_per_node=need, nodes=1)
        own = own_layout(cfg, work, cluster, self.registry.strategies)
        if own.layout is None:
            return None, own.why
        return float(own.layout.step_time_s), ""

    # -- the sweep and the budget search ----------------------------------------------------------
    def sweep(self) -> list[dict[str, Any]]:
        (self.out_dir / "points.jsonl").unlink(missing_ok=True)  # this bench's points only
        self.load_start = machine_load()
        for name in self.layouts:
            got = self.run(name, self.vision_tokens)
            self.points += got
            self.keep(got)
        return self.points

    def predicted_limit(self, name: str) -> int:
        """The longest length (whole windows, at most :data:`PREDICTED_CAP` of them) the analytic
        model says fits the budget (:func:`~disagg.bench.fit_search.longest_fitting`)."""
        assert self.budget is not None
        unit = self.window_side**2
        text = self._text_tokens()

        def fits(k: int) -> bool:
            n = k * unit
            return (
                self.predict(name, n, self.samples * (n // self.vision.unit + text))["memory_per_rank"]
                <= self.budget
            )

        return longest_fitting(fits, PREDICTED_CAP) * unit

    def _text_tokens(self) -> int:
        for p in self.points:
            if "measured" in p:
                return (
                    p["measured"]["tokens_per_step"] // self.samples - p["vision_tokens"] // self.vision.unit
                )
        return 32

    def largest_under_budget(self, name: str, rounds: int = 2) -> dict[str, Any]:
        """The longest vision length whose measured memory per rank fits, by a
        search with real steps: the bracket from the sweep (longest fitting,
        shortest over) is narrowed in ``rounds`` runs of up to 3 lengths each,
        placed around the analytic model's limit when it lies inside the bracket
        (the bisection's midpoints otherwise)."""
        assert self.budget is not None
        unit = self.window_side**2
        mine = [p for p in self.points if p["layout"] == name and "measured" in p]
        lo = max((p["vision_tokens"] for p in mine if p["fits_budget"]), default=0)
        hi = min(
            (p["vision_tokens"] for p in mine if not p["fits_budget"] and p["vision_tokens"] > lo), default=0
        )
        guess = self.predicted_limit(name)
        cap = self.max_vision_tokens or 4 * max(self.vision_tokens)
        probes: list[dict[str, Any]] = []
        for _ in range(rounds):
            if hi and (hi - lo <= unit or hi <= 1.15 * lo):
                break
            if not hi and lo >= cap:
                break
            top = hi or min(cap, max(4 * max(lo, unit), 2 * guess))
            if lo < guess < top:
                cands = [guess * 0.9, guess, guess * 1.1 + unit]
            elif not hi:  # nothing over budget yet: try the top itself, and on the way
                cands = [lo + (top - lo) * f for f in (0.5, 0.75, 1.0)]
            else:
                cands = [lo + (top - lo) * f for f in (0.25, 0.5, 0.75)]
            # photo-like grids only: a prime number of windows is one long strip
            # (a 4x844 grid at 3376 patches), which the image processor refuses
            snapped = sorted(
                {snap_length(max(unit, int(c)), self.window_side, self.vision.merge) for c in cands}
                - {lo, hi}
            )
            snapped = [n for n in snapped if lo < n <= (hi - 1 if hi else cap)]
            if not snapped:
                break
            got = self.run(name, snapped, steps=1, tag=" probe")
            probes += got
            self.keep(got)
            for p in got:
                if p.get("fits_budget"):
                    lo = max(lo, p["vision_tokens"])
                elif p.get("fits_budget") is False and p["vision_tokens"] > lo:
                    hi = min(hi or p["vision_tokens"], p["vision_tokens"])
        return {
            "largest_fitting": lo,
            "smallest_over": hi or None,
            "capped_at": cap if not hi else None,
            "predicted_limit": guess,
            "probes": probes,
        }


def _fits(point: dict[str, Any], budget: int) -> bool | None:
    """Measured memory within the budget; a point that ran out of device memory
    does not fit; one that failed otherwise is unknown (None) and the search
    ignores it."""
    if "measured" in point:
        return bool(point["memory_per_rank"]["measured"] <= budget)
    error = point.get("error", "").lower()
    return False if ("out of memory" in error or "outofmemory" in error) else None
