"""What ddipp does without fastai, written once for every adapter: the process group and devices, collectives,
sharding of index orders and the exact-evaluation gather, the SyncBatchNorm swap, atomic files, and the notebook's
worker group with its wire. Nothing here imports fastai."""
