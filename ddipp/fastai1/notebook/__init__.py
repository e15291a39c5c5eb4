"""Notebook mode: a notebook's learner fits on a persistent group of worker processes, one per device.

How one fit flows (each box a module of this package)::

    notebook                                        worker process (one per rank, fresh interpreter)
    --------                                        ------------------------------------------------
    learn.fit(...)  -> binding.fit_on_group   (learn.fit of a learner core.group.binding bound)
                    -> fitting.fit_call   (the learner as bytes: shipping; tensors the workers kept, as digests)
                    -> group.WorkerGroup  ==socket==> worker.Worker (its command loop)
                                                        -> fitting.run_fit: learn.to_ddp(), learn.fit(...)
                       progress.ProgressMirror <==== progress.ProgressRelay (rank 0's bars, prints)
                       fitting.apply_results  <==== rank 0's weights, optimizer state, callbacks

Commands the notebook sends, each the name of a `Worker` method: "set_context", "keep_data", "fit", "leave", "stop".
Replies: "ready", "done" (a fit's results, the digests of what each rank keeps), "trained" (rank 0's results as of
its last completed step, ahead of a failed fit's error), "error" (a pickled exception and its traceback), "out"
(rank 0's prints) and progress events. The store the workers rendezvous on listens on loopback only, for the
group's life (the ranks meet there again after a failed fit).
"""
