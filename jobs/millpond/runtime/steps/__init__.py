"""One micro-batch as named steps, in order: plan, read, dedup, watermark, compute, validate, commit.

Each step is a few functions over the batch (``runtime.microbatch.MicroBatch``: its settings, spec,
tables, store and commits) with its inputs and outputs explicit."""
