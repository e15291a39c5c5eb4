"""Notebook mode: a notebook's learner fits on a persistent group of worker processes, one per device.

How one fit flows (each box a module of this package, or of ddipp.core.group)::

    notebook                                        worker process (one per rank: forked from the kernel's
    --------                                        fork server, or a fresh interpreter: core.group.forkserver)
                                                    ------------------------------------------------------
    learn.fit(...)  -> binding.fit_on_group -> core.group.binding.fit_on_group
                    -> fitting.fit_call   (the learner as bytes: shipping; tensors the workers kept, as digests)
                    -> group.WorkerGroup  ==socket==> worker.Worker (its command loop)
                                                        -> fitting.run_fit: learner.distribute(), learn.fit(...)
                                                           (core.group.fitting: what both adapters do around it;
                                                           core.state.full_state on every rank after it)
                       progress.ProgressMirror <==== progress.ProgressRelay (rank 0's bars)
                       (prints)                <==== core.group.output (rank 0's prints and warnings)
                       fitting.apply_results  <==== rank 0's weights and optimizer state (full_state), callbacks

The messages between the two sides are named in ddipp.core.group.messages. The store the workers rendezvous on
listens on loopback only, for the group's life (the ranks meet there again after a failed fit).
"""
