"""The names of the messages between the notebook's group and its workers, each a tuple (name, *arguments) that `wire`
pickles: the notebook's commands, the workers' replies, and the progress events of rank 0's fit.

Each name is that of the method that acts on the message: a command, of `worker.Worker`; a reply, of
`group.WorkerGroup` (`_on_<name>`); a progress event, of the adapter's `notebook.progress.ProgressMirror`.
"""

# Commands, the notebook to every worker
SET_CONTEXT = "set_context"  # the notebook's directory and sys.path
KEEP_DATA = "keep_data"  # the data a fit trains on, kept until other data comes
FIT = "fit"  # a learner and a fit call: run it under DDP
LEAVE = "leave"  # the process group, after another rank's failed fit (the next fit forms a new one)
STOP = "stop"  # end the worker

# Replies, a worker to the notebook
READY = "ready"  # joined the process group (its pid)
DONE = "done"  # a fit's end: rank 0's results, and the digests of the tensors this rank keeps for the next fit
TRAINED = "trained"  # rank 0's results as of its last completed step, ahead of the error of a fit that failed
ERROR = "error"  # a pickled exception and its traceback
OUT = "out"  # rank 0's prints and warnings: the stream's name and the text

# Rank 0's progress events, sent by the adapter's ProgressRelay; fastai v1's and v2's bars differ, so do their events
WRITE = "write"  # a line of the results table
GRAPH = "graph"  # the loss graph
CHILD = "child"  # a new bar over one pass of a loader
BEGIN, MAIN, CHILD_UPDATE, INTERRUPT = "begin", "main", "child_update", "interrupt"  # v1: master bar, epoch, step, stop
MASTER, EPOCH, MASTER_END, UPDATE, CHILD_END = "master", "epoch", "master_end", "update", "child_end"  # v2
