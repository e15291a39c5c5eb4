"""The notebook's worker group, fastai-free: the processes (group), their command loop (worker) and the wire.

The notebook side (`group.WorkerGroup`) sends commands to the workers (`worker.Worker`) and serves their replies and
rank 0's progress events, every message a tuple whose name `messages` lists, pickled by `wire`. What a fit does on a
rank, and how a learner's parts travel, is the adapter's: the fitting module it names when it binds a learner
(`binding.bind`), which a worker imports, holds the contract in `adapter.Fitting`.
"""
