"""A frozen encoder's feature cache (``parallel.<m>.feature_cache``) in the planner's step model.

What the run does: the first time a sample is seen its frozen encoder runs forward only (no
backward, nothing to step) and the output is stored; every later step that meets the sample
finds it cached and the encoder is not called at all (``encode_calls_per_rank`` 0). The cached
rows still travel to the LLM (from the object store or the disk), and the run still makes the
group's per-step calls.

The model, per step, is the **expected cost over the run's epochs**: over ``E`` epochs the encoder
runs on a share ``1/E`` of the steps' samples (epoch 1) and looks up the rest, so its compute, its
collectives and its per-layer launches are charged ``× 1/E``; its transfer to the LLM and its
per-step calls are charged in full; its memory stays epoch 1's (a forward's activations are the
peak). ``E`` is ``train.steps × data.batch_size / samples in data.train`` (at least 1: a run
shorter than an epoch gains nothing); where the samples cannot be counted (no ``data``) the module
is charged as uncached. ``share = 0`` is the epoch-2 steady state (``disagg bench``'s ratio).
Eviction is not modelled: a ``host`` cache smaller than an epoch's outputs is charged as if it held
them.
"""

from __future__ import annotations

from typing import Any

from disagg.config.schema import Config

#: per-step driver calls a group serves whatever it encodes (reduce_and_norm, step)
STEP_CALLS = 2


def cached_times(times: dict[str, float], share: float, call_latency: float) -> dict[str, float]:
    """A cached frozen encoder's per-step seconds (:func:`disagg.plan.model.evaluate`'s terms)
    when it encodes only ``share`` of the samples: the encoder's work scales, the transfer of
    its rows to the LLM and the per-step calls do not."""
    if share >= 1.0:
        return times
    calls = STEP_CALLS * call_latency
    out = dict(times)
    out["compute_s"] = share * times["compute_s"]
    out["collective_s"] = share * times["collective_s"]
    out["overhead_s"] = calls + share * max(0.0, times["overhead_s"] - calls)
    return out


def encoded_shares(cfg: Config) -> dict[str, float]:
    """Module -> share of its samples a step still encodes, for each module ``cfg`` caches
    (``1/E`` over the run's ``E`` epochs; see the module doc)."""
    cached = [m for m in cfg.modules() if m != "llm" and getattr(cfg.parallel, m).feature_cache != "none"]
    if not cached:
        return {}
    epochs = run_epochs(cfg)
    if epochs is None:
        return {}
    return {m: 1.0 / max(1.0, epochs) for m in cached}


def run_epochs(cfg: Config) -> float | None:
    """Epochs the run covers: ``train.epochs``, else ``train.steps x data.batch_size`` over the
    samples in ``data.train``; None where they cannot be counted."""
    if cfg.train.epochs is not None:
        return float(cfg.train.epochs)
    if cfg.data is None:
        return None
    from disagg.data.files import dataset_files, index_file

    try:
        samples = sum(index_file(f).size for f in dataset_files(cfg, "train"))
    except Exception:  # a source validation has not counted: charged as uncached
        return None
    return cfg.train.steps * cfg.data.batch_size / samples if samples else None


#: ``parallel.<m>`` keys of the feature cache, which the user sets and the planner never chooses
CACHE_KEYS = ("feature_cache", "feature_cache_gb", "feature_cache_dir", "feature_cache_ahead")


def user_cache_keys(cfg: Config) -> dict[str, dict[str, Any]]:
    """Per module, the feature-cache keys the user set: ``parallel: auto`` puts the planner's
    groups in place of the user's and must carry these over (the plan was costed with them)."""
    out: dict[str, dict[str, Any]] = {}
    for m in cfg.modules():
        g = getattr(cfg.parallel, m)
        keys = {k: getattr(g, k) for k in CACHE_KEYS if k in g.model_fields_set}
        if keys:
            out[m] = keys
    return out
