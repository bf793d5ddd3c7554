"""``python -m disagg.gpucheck``: one GPU check that runs on a bare GPU host (no Ray, no nox,
no network), and on CPU at tiny shapes (``--device cpu``).

Four parts, one JSON report (``--out``), exit status non-zero when any check fails or when
nothing ran:

1. ``correctness`` (:mod:`.correctness`): every strategy at one rank, ``recompute: full``, in
   the run's precision recipe, against the Hugging Face model on the same device and recipe:
   loss, gradients and parameters (in learning-rate units, with the reference's gradients)
   after 2 steps on images that matter; two injected faults (a skipped optimizer step, images
   replaced by noise) must both be caught; per layout, ``torch.cuda.max_memory_allocated``
   over its steps beside the cost model's bytes for the same batch (:mod:`.layout_memory`).
2. ``calibration`` (:mod:`.calibration`): the time model's terms measured at the shard shapes
   of the published layouts, written as a cluster file ``disagg plan --calibration`` loads.
3. ``memory`` (:mod:`.memory`): one vision block and one LLM layer of Qwen2.5-VL-32B at a long
   sequence, the allocator's peak beside the cost model's prediction.
4. ``mechanism`` (:mod:`.mechanism`): the vision block's throughput in Ulysses shard shapes
   against TP-8 shard shapes, and each strategy's MFU in the runtime's recipe.

Nothing here imports Ray: strategies are driven through the test kit's one-rank calls
(:mod:`disagg.testing.ranks`) in a ``torch.distributed`` world of size 1.
"""
