"""The notebook's worker group, fastai-free: the processes (group), their command loop (worker) and the wire.

The notebook side (`group.WorkerGroup`) sends commands, each the name of a `worker.Worker` method: "set_context",
"keep_data", "fit", "leave" (the process group, after another rank's failed fit; the next fit re-forms it through the
notebook's loopback store), "stop"; replies are "ready", "done" (rank 0's results of a fit, and each rank's digests of
the tensors it keeps for the next fit, which names them instead of sending them), "trained" (rank 0's results as of
its last completed step, before the error of a fit that failed), "error" (a pickled exception and its traceback), "out"
(rank 0's prints) and progress events, every message pickled by `wire`. What a fit does on a
rank, and how a learner's parts travel, is the adapter's (`ddipp.fastai1.notebook`).
"""
